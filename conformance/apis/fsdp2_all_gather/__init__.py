"""FSDP2's custom all-gather comm (``FSDPModule.set_custom_all_gather``): api ``fsdp2_all_gather``."""
