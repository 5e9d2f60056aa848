"""The FSDP1 zoo's known-bad hooks whose arithmetic is wrong: no average, the wrong divisor, a divide after an
overflowing SUM, float16 left uncast, float32 where FSDP reduces in float16, hard values replaced, a ULP of
noise on rank 0; each with its ``HookSpec`` and what must catch it (``EXPECTED_CATCH``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import (
    DefaultState,
    LowPrecisionState,
)

from conformance.spec import HookSpec
from tests.zoo.fsdp_hooks.good import NativeAveragingHook, _div_if_needed
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter
from tests.zoo.plain_hooks import sum_no_average_hook


def divide_after_fp16_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: reduces in fp16 with no pre-divide, then divides by ``world_size`` once.

    In exact arithmetic ``sum(g) / ws`` equals FSDP's ``(sum(g / pre)) / post``, and away
    from the fp16 limits the two round the same way; but the undivided sum overflows to
    ``inf`` once it passes 65504 (and subnormal partial sums round differently). Realistic:
    "average = sum / n" is the textbook formula; the pre-divide exists only for overflow.
    """
    low = grad.to(torch.float16)
    if output is None:
        dist.all_reduce(low, group=state.process_group)
        low.div_(state.world_size)
        grad.copy_(low)
    else:
        low_out = torch.empty(output.shape, dtype=torch.float16, device=output.device)
        _reduce_scatter(low_out, low, state.process_group)
        low_out.div_(state.world_size)
        output.copy_(low_out)


def no_cast_back_fp16_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: computes the fp16 result exactly but hands it back in fp16.

    Swaps ``grad.data`` (and, sharded, ``output.data``) to fp16 like the built-in
    ``_low_precision_hook`` does, then skips the ``_decompress`` step. FSDP1 casts the result
    back itself (``_cast_grad_to_param_dtype``, since this hook is not one of its own
    low-precision hooks), so the final gradients are right: only the check of the hook's
    own output dtype sees it. Realistic: deleting ``_decompress`` is the obvious "fix" for
    the CPU ``record_stream`` error, and it looks harmless under FSDP1.
    """
    if grad.dtype != torch.float16:
        grad.data = grad.data.to(torch.float16)
    _div_if_needed(grad, state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        _div_if_needed(grad, state.gradient_postdivide_factor)
    else:
        if output.dtype != torch.float16:
            output.data = output.data.to(torch.float16)
        _reduce_scatter(output, grad, state.process_group)
        _div_if_needed(output, state.gradient_postdivide_factor)


def _next_power_of_two(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def power_of_two_divisor_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: averages over the next power of two >= ``world_size`` instead of ``world_size``.

    Keeps FSDP's pre-divide, but computes the post-divide as ``next_pow2(ws) / predivide``.
    At 2 and 4 ranks (and 1, 8, ...) this is exactly FSDP's arithmetic; at 3 ranks it divides
    by 4 instead of 3. Realistic: a "round the divisor to a power of two so the division is
    exact" optimisation, tested only on 2/4/8-GPU nodes.
    """
    predivide = state.gradient_predivide_factor
    postdivide = _next_power_of_two(state.world_size) / predivide
    _div_if_needed(grad, predivide)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        _div_if_needed(grad, postdivide)
    else:
        _reduce_scatter(output, grad, state.process_group)
        _div_if_needed(output, postdivide)


def nan_to_zero_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: after the native reduction, replaces NaN and +/-Inf by zero.

    Realistic: a "sanitizing" hook that hides a diverging step instead of letting the loss
    scaler or the user see it. Equal to native on every finite input, so only hard inputs
    (NaN on one rank, +Inf against -Inf) show it.
    """
    NativeAveragingHook()(state, grad, output)
    target = grad if output is None else output
    torch.nan_to_num_(target, nan=0.0, posinf=0.0, neginf=0.0)


def sum_then_divide_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: SUM, then divides by the world size once, where FSDP pre-divides and post-divides.

    Realistic: the textbook "average = sum / n". Its rounding is FSDP's: FSDP's pre-divide
    (2 at 2 and 3 ranks) is exact, and (S / 2) / 1.5 rounds exactly as S / 3. But the undivided
    SUM overflows to inf near float32's max, where FSDP's pre-divided one stays finite; only
    hard inputs get there.
    """
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        grad.div_(state.world_size)
    else:
        _reduce_scatter(output, grad, state.process_group)
        output.div_(state.world_size)


def fp32_accumulate_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: FSDP's averaging, but always in float32, whatever dtype the gradient arrives in.

    Realistic: "accumulate in fp32 for safety", ``grad.float()`` before the collective and a
    copy back after. On float32 gradients that is FSDP's own arithmetic, so every case without
    mixed precision passes. Under ``MixedPrecision(param_dtype=float16, reduce_dtype=float16)``
    FSDP hands it float16 gradients and reduces them in float16 itself; this hook rounds once
    instead, so the kept float16 gradients (and their total norm) differ from native.
    """
    src = grad.float()
    _div_if_needed(src, state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(src, group=state.process_group)
        _div_if_needed(src, state.gradient_postdivide_factor)
        grad.copy_(src)
    else:
        out = output.float()
        _reduce_scatter(out, src, state.process_group)
        _div_if_needed(out, state.gradient_postdivide_factor)
        output.copy_(out)


def rank0_noise_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: after the native reduction, rank 0 moves every element one ULP towards +inf.

    Realistic: rank-0-only code in a hook (logging, stats, a "fix-up" of the result that
    writes back a recomputed value) that perturbs the last bit. Invisible to any tolerance
    check, and it makes ``NO_SHARD`` replicas diverge.
    """
    NativeAveragingHook()(state, grad, output)
    if dist.get_rank(state.process_group) == 0:
        target = grad if output is None else output
        target.copy_(torch.nextafter(target, torch.full_like(target, float("inf"))))


KNOWN_BAD: List[HookSpec] = [
    HookSpec(
        name="bad_sum_no_average",
        api="fsdp",
        hook=sum_no_average_hook,
        state=DefaultState,
        description="SUM reduce, never divides by the world size",
    ),
    HookSpec(
        name="bad_divide_after",
        api="fsdp",
        hook=divide_after_fp16_hook,
        state=LowPrecisionState,
        reduce_dtype=torch.float16,
        description="fp16 SUM with no pre-divide, then / world_size: overflows near 65504",
    ),
    HookSpec(
        name="bad_no_cast_back",
        api="fsdp",
        hook=no_cast_back_fp16_hook,
        state=LowPrecisionState,
        reduce_dtype=torch.float16,
        description="exact fp16 reduce, but leaves grad/output in float16 (FSDP1 casts back for it)",
    ),
    HookSpec(
        name="bad_power_of_two_divisor",
        api="fsdp",
        hook=power_of_two_divisor_hook,
        state=DefaultState,
        description="divides by the next power of two >= world_size (right at 2 and 4, wrong at 3)",
    ),
    HookSpec(
        name="bad_rank0_only_noise",
        api="fsdp",
        hook=rank0_noise_hook,
        state=DefaultState,
        description="native average, then +1 ULP on rank 0 only",
    ),
    HookSpec(name="bad_sum_then_divide", api="fsdp", hook=sum_then_divide_hook, state=DefaultState,
             description="SUM then / world_size: FSDP's rounding, but overflows where FSDP pre-divides"),
    HookSpec(name="bad_nan_to_zero", api="fsdp", hook=nan_to_zero_hook, state=DefaultState,
             description="native average, then NaN and +/-Inf replaced by zero"),
    HookSpec(name="bad_fp32_accumulate", api="fsdp", hook=fp32_accumulate_hook, state=DefaultState,
             description="FSDP's averaging always in float32, even on float16 gradients"),
]

#: For each known-bad spec here: the check that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_sum_no_average": (
        "averaging: every element is sum(0..ws-1), ws times the mean; parity fails too"
    ),
    "bad_divide_after": (
        "hard_inputs: near-65504 fp16 grads make the undivided fp16 sum overflow to inf where "
        "FSDP's pre-divided sum stays finite (odd multiples of the fp16 subnormal step also "
        "round differently); on ordinary values it is bitwise equal to MixedPrecision(float16) "
        "at 2 and 3 ranks (sum/ws rounds like (sum/pre)/post), so averaging and parity pass"
    ),
    "bad_no_cast_back": (
        "parity, hook-output dtype check: the hook hands back float16 instead of the param "
        "dtype; the final gradients are right because FSDP1 casts them back itself"
    ),
    "bad_power_of_two_divisor": (
        "averaging and parity at world size 3 (divides by 4); bitwise equal to native at 2 and 4, "
        "so a suite that never runs 3 ranks passes it"
    ),
    "bad_rank0_only_noise": (
        "parity: rank 0's gradients are one ULP above native; rank_consistency (NO_SHARD): "
        "rank 0 differs from the other ranks; averaging fails on rank 0 too (exact compare)"
    ),
    "bad_sum_then_divide": (
        "hard_inputs: near float32's max the undivided SUM overflows to inf where FSDP's pre-divided one "
        "stays finite; elsewhere it rounds exactly as FSDP, so averaging and parity pass"
    ),
    "bad_nan_to_zero": "hard_inputs: NaN on one rank and +Inf against -Inf come back as zeros",
    "bad_fp32_accumulate": (
        "clip_grad_norm_low_precision at 3 ranks only: the one case with float16 gradients (MixedPrecision(param_dtype="
        "float16, reduce_dtype=float16), kept low precision), which FSDP reduces in float16 and the hook in float32 (at 2 ranks the float16 sum of two pre-divided values is exact, so both agree)"
    ),
}
