"""PyTorch's own hooks, as specs: what the suite tests when no ``--hook`` is given.

One module per hook API, each exporting a list of :class:`~conformance.spec.HookSpec`:

* ``fsdp.py`` (``FSDP_HOOKS``): ``FullyShardedDataParallel.register_comm_hook``'s
  built-in hooks from ``torch.distributed.algorithms._comm_hooks.default_hooks``;
* ``ddp.py`` (``DDP_HOOKS``): ``DistributedDataParallel.register_comm_hook``'s
  hooks from ``torch.distributed.algorithms.ddp_comm_hooks``;
* ``fsdp2.py`` (``FSDP2_HOOKS``): a plain FSDP2 ``ReduceScatter`` comm, the
  known-good comm to copy (``PlainReduceScatter``).

The targets are listed in :data:`conformance.spec_loading.BUILTIN_TARGETS`.
"""
