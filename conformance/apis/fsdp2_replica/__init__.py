"""The FSDP2 replica all-reduce API: ``FSDPModule.set_all_reduce_hook`` on a 1-D shard mesh, the hook being the whole reduction across replicas."""
