"""The ``fsdp2_all_reduce`` hook API: ``FSDPModule.set_all_reduce_hook(hook)`` under native HSDP, or under
``replicate`` built on FSDP2, where FSDP2 calls the hook after its own all-reduce."""
