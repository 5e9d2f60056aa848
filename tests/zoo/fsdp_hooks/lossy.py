"""The FSDP1 zoo's lossy story, ``LOSSY``, with each spec's contract and, for the bad ones, what must catch it
(``LOSSY_EXPECTED``). It holds hooks that are lossy by design and declare a ``LossyContract`` (run by
``tests/test_meta_lossy.py``, not by the exact zoo run): a bfloat16 compression hook with a
generous bound, which passes with its figure, and an 8-bit quantizing hook whose declared
bound is too tight.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec, LossyContract
from tests.zoo.fsdp_hooks.good import _reduce_in
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter


def bf16_compress_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Lossy: bfloat16 compression of a float32 model, as ``bf16_compress_hook`` does, CPU-portable.

    FSDP's averaging (pre-divide, SUM, post-divide) in bfloat16, the result written back in the
    parameter dtype. Claims no reduce dtype: the float32 model's gradients lose 16 mantissa bits on
    the wire. Realistic: bandwidth saved on purpose, with the precision given up declared.
    """
    _reduce_in(torch.bfloat16, state, grad, output)


def int8_quantize_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Lossy: 8-bit quantization with one scale per FSDP unit (its flat gradient).

    The scale is the largest magnitude over every rank's flat gradient / 127; each rank rounds its
    gradient to integers in [-127, 127], the integers are summed exactly in int32 (all-reduce, or
    reduce-scatter into this rank's shard), then scaled back and divided by the world size.
    Parameters whose gradients are small beside the unit's largest lose most of their digits.
    Realistic: per-tensor int8 gradient compression (as PyTorch's ``quantization_pertensor_hook``).
    """
    amax = grad.detach().abs().max().reshape(1).to(torch.float32)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=state.process_group)
    _int8_average(state.process_group, grad, output, float(amax) / 127 if float(amax) > 0 else 1.0)


def _int8_average(group: Any, grad: torch.Tensor, output: Optional[torch.Tensor], scale: float) -> None:
    """Round ``grad / scale`` to int32, SUM the integers over ``group`` (all-reduce, or reduce-scatter into
    ``output``), and write them back times ``scale`` / the group size."""
    q = torch.round(grad.detach() / scale).to(torch.int32)
    world_size = dist.get_world_size(group)
    if output is None:
        dist.all_reduce(q, group=group)
        grad.copy_(q.to(grad.dtype) * scale / world_size)
    else:
        q_out = torch.empty(output.shape, dtype=torch.int32, device=output.device)
        _reduce_scatter(q_out, q, group)
        output.copy_(q_out.to(output.dtype) * scale / world_size)


def int8_own_scale_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Lossy and wrong: :func:`int8_quantize_hook` with each rank's own scale instead of one shared scale.

    Each rank rounds its gradient to integers with the scale of its own largest magnitude, the
    integers of every rank are summed, and each rank scales the sum back with its own scale: right only
    where every rank's gradients are about as large as this rank's. A data-parallel batch on one rank
    can give gradients 100x another's; then the other ranks' integers are read in this rank's units.
    """
    amax = float(grad.detach().abs().max())
    _int8_average(state.process_group, grad, output, amax / 127 if amax > 0 else 1.0)


#: A generous contract for bfloat16 compression: 1e-2 relative error per step and parameter (bfloat16
#: rounds each value to 2**-9 relative, before the SUM, after it and after each divide), the training loss
#: within 5% of native full precision after 10 steps, the same bits from the same seed. Observed (gloo,
#: CPU, torch 2.13, the 6 steps of test_lossy_error): 2.8e-3 at 2 ranks, 5.5e-3 at 3 (FSDP's pre-divide
#: by 2 and post-divide by 1.5 round once more); loss 1.5e-4 relative after 10 steps.
GENEROUS_BF16 = LossyContract(rel_error_bound=1e-2, deterministic=True, loss_margin=0.05, loss_steps=10)

#: A contract an 8-bit quantizer with one shared scale keeps: 0.1 relative error per step and parameter, the
#: training loss within 10% after 10 steps. Observed (gloo, CPU, torch 2.13): at most 4.2e-2 in
#: test_lossy_error, also in its steps whose per-rank gradient magnitudes differ (1x, 0.01x, 0.0001x); loss
#: 5.4e-2 relative. With each rank's own scale: 2.7e-2 while the ranks' gradients are alike, 0.98 to 2.0 once
#: they differ.
INT8_BOUND = LossyContract(rel_error_bound=0.1, loss_margin=0.1, loss_steps=10)

#: The lossy-contract story (``tests/meta_zoos/``'s ``LOSSY``, and ``tests/test_meta_lossy.py``).
LOSSY_GOOD: List[HookSpec] = [
    HookSpec(name="good_bf16_compress_lossy", api="fsdp", hook=bf16_compress_hook, state=DefaultState,
             lossy=GENEROUS_BF16, description="bfloat16 compression of a float32 model, declared lossy"),
    HookSpec(name="good_int8_shared_scale", api="fsdp", hook=int8_quantize_hook, state=DefaultState,
             lossy=INT8_BOUND, description="8-bit quantization, one scale shared by every rank, declared 0.1"),
]
LOSSY_BAD: List[HookSpec] = [
    HookSpec(name="bad_int8_exceeds_bound", api="fsdp", hook=int8_quantize_hook, state=DefaultState,
             lossy=LossyContract(rel_error_bound=1e-2, deterministic=True),
             description="8-bit quantization, one scale per FSDP unit, declared within a bfloat16-like 1e-2"),
    HookSpec(name="bad_int8_undeclared", api="fsdp", hook=int8_quantize_hook, state=DefaultState,
             description="the same 8-bit quantization claiming FSDP's full-precision averaging"),
    HookSpec(name="bad_int8_own_scale", api="fsdp", hook=int8_own_scale_hook, state=DefaultState,
             strategies=("FULL_SHARD", "SHARD_GRAD_OP"), lossy=LossyContract(rel_error_bound=0.1),
             description="8-bit quantization with each rank's own scale, sharded strategies, declared 0.1"),
]
LOSSY: List[HookSpec] = LOSSY_GOOD + LOSSY_BAD

#: For each lossy-story bad spec, the check that must catch it and why.
LOSSY_EXPECTED: Dict[str, str] = {
    "bad_int8_exceeds_bound": (
        "lossy_error: one 8-bit scale per FSDP unit leaves the parameters with small gradients (biases) a "
        "relative error far above the declared 1e-2"),
    "bad_int8_undeclared": (
        "averaging and parity, with the hint to declare a LossyContract: no exact cause (a divisor, a dtype, "
        "a stale step) reproduces 8-bit rounding"),
    "bad_int8_own_scale": (
        "lossy_error, in its steps whose per-rank gradient magnitudes differ (1x, 0.01x, 0.0001x): each rank reads "
        "the summed integers in its own units. While every rank's gradients are alike its error (2.7e-2) is the "
        "shared-scale quantizer's, inside the declared 0.1; sharded, it has no rank-consistency case (NO_SHARD "
        "only, where the ranks' gradients part), and it declares no loss margin"),
}
