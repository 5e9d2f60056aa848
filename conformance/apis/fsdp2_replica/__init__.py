"""The ``fsdp2_replica`` hook API: ``FSDPModule.set_all_reduce_hook`` on a 1-D shard mesh, where the hook
is the whole reduction across replicas."""
