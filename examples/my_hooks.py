"""The README's plug-in example hook (torch only: its spec is in my_specs.py), tested by
tests/test_readme_example.py."""

import torch
import torch.distributed as dist

# torch 2.13 renames reduce_scatter_tensor (deprecated there) to reduce_scatter_single; older torch has the first.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        reduce_scatter(shard, low, group=state.process_group)
        result, target = shard, output
    if state.gradient_postdivide_factor > 1:
        result.div_(state.gradient_postdivide_factor)
    target.copy_(result)                     # back to the parameter dtype
