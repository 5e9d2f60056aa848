"""The ``fsdp2`` hook API: FSDP2's ``FSDPModule.set_custom_reduce_scatter(comm)``."""
