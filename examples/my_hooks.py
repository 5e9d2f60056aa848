"""The README's plug-in example, tested by tests/test_readme_example.py."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import LowPrecisionState
from conformance import HookSpec


def fp16_hook(state, grad, output=None):
    """Reduce in fp16 exactly as FSDP's MixedPrecision(reduce_dtype=fp16) does, cast back."""
    low = grad.to(torch.float16)
    if state.gradient_predivide_factor > 1:
        low.div_(state.gradient_predivide_factor)
    if output is None:                       # NO_SHARD: reduce the whole flat gradient
        dist.all_reduce(low, group=state.process_group)
        result, target = low, grad
    else:                                    # FULL_SHARD / SHARD_GRAD_OP: fill this rank's shard
        shard = torch.empty(output.shape, dtype=torch.float16, device=output.device)
        dist.reduce_scatter_tensor(shard, low, group=state.process_group)
        result, target = shard, output
    if state.gradient_postdivide_factor > 1:
        result.div_(state.gradient_postdivide_factor)
    target.copy_(result)                     # back to the parameter dtype


SPEC = HookSpec(
    name="my_fp16",                # unique; appears in every test id of this hook
    api="fsdp",                    # FullyShardedDataParallel.register_comm_hook
    hook=fp16_hook,                # hook(state, grad) for NO_SHARD, hook(state, grad, output) for sharded
    state=LowPrecisionState,       # called on each rank as state(process_group)
    reduce_dtype=torch.float16,    # the claim: None = full-precision averaging; X = MixedPrecision(reduce_dtype=X)
)
