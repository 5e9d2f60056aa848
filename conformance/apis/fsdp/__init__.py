"""The ``fsdp`` hook API: ``FullyShardedDataParallel.register_comm_hook`` (FSDP1)."""
