"""The README's example specs, tested by tests/test_readme_example.py: what `--hook` names. The hooks live in
modules that import only torch (my_hooks.py, my_ddp_hook.py), so a standalone reproducer of a failure imports
them without the suite; this module imports both the suite and the hooks."""

import torch
from torch.distributed.algorithms._comm_hooks.default_hooks import LowPrecisionState

from conformance import HookSpec
from .my_hooks import fp16_hook

SPEC = HookSpec(
    name="my_fp16",                # unique; appears in every test id of this hook
    api="fsdp",                    # FullyShardedDataParallel.register_comm_hook
    hook=fp16_hook,                # hook(state, grad) for NO_SHARD, hook(state, grad, output) for sharded
    state=LowPrecisionState,       # called on each rank as state(process_group)
    reduce_dtype=torch.float16,    # the claim: None = full-precision averaging; X = MixedPrecision(reduce_dtype=X)
    param_dtype=None,              # the parameters it is meant for: None = float32; X = every check trains in X
)

# README's DDP example (api "ddp"), below the FSDP one as README shows them.
from .my_ddp_hook import allreduce_mean, process_group_state

DDP_SPEC = HookSpec(name="my_ddp_mean", api="ddp", hook=allreduce_mean, state=process_group_state)

SPECS = [SPEC, DDP_SPEC]           # --hook conformance.examples.my_specs:SPECS checks both
