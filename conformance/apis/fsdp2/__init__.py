"""The ``fsdp2`` and ``fsdp2_all_reduce`` hook APIs: FSDP2's ``set_custom_reduce_scatter`` and
``set_all_reduce_hook``."""
