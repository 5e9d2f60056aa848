"""The ``ddp`` hook API: ``DistributedDataParallel.register_comm_hook``."""
