"""A zoo of FSDP1 gradient communication hooks: known-good and known-bad.

The suite's meta-tests run every check over these hooks. Each known-good hook must pass
every check; each known-bad hook must be caught by at least one, and ``EXPECTED_CATCH``
names the check that must catch it and why no weaker check can.

What "good" means here is fixed by FSDP1 itself (``torch/distributed/fsdp/_runtime_utils.py``):

* full precision (``_reduce_grad`` / ``_reduce_grad_no_shard`` with no hook): divide the
  gradient by ``DefaultState._get_gradient_predivide_factor(world_size)`` (a power of two) if
  it is > 1, reduce with SUM (``all_reduce`` for ``NO_SHARD``, ``reduce_scatter_single`` of
  the padded flat gradient for the sharded strategies), then divide by the post-divide factor
  ``world_size / predivide`` if it is > 1;
* ``MixedPrecision(reduce_dtype=X)``: cast the gradient to ``X`` first
  (``_post_backward_hook``), do all of the above in ``X``, then cast the result back to the
  parameter dtype (``_cast_grad_to_param_dtype``).

A hook registered with ``register_comm_hook`` gets the gradient in the parameter dtype (FSDP
skips its own cast to the reduce dtype when a hook is set), is called as
``hook(state, grad)`` under ``NO_SHARD`` and ``hook(state, grad, output)`` under
``FULL_SHARD``/``SHARD_GRAD_OP``. Every hook here takes ``output=None`` and so serves all three
strategies, except ``bad_wrong_shard``, which has no ``NO_SHARD`` form.

PyTorch's own ``fp16_compress_hook``/``bf16_compress_hook`` raise on CPU (``_decompress``
calls ``record_stream``), so the low-precision good hooks here cast back without it.

``LOSSY`` holds hooks that are lossy by design and declare a ``LossyContract`` (run by
``tests/test_meta_lossy.py``, not by the exact zoo run): a bfloat16 compression hook with a
generous bound, which passes with its figure, and an 8-bit quantizing hook whose declared
bound is too tight.

Only ``torch`` and ``torch.distributed`` are imported at module level: the zoo is imported
by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import (
    DefaultState,
    LowPrecisionState,
)

from conformance.spec import HookSpec, LossyContract
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter
from tests.zoo.plain_hooks import sum_no_average_hook

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "LOSSY", "LOSSY_EXPECTED", "make_state"]

_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


# ---------------------------------------------------------------------------
# Collectives. ``reduce_scatter_single`` is what FSDP1 calls; older torch only has
# ``reduce_scatter_tensor`` (deprecated in favour of ``reduce_scatter_single`` in 2.13).
# ---------------------------------------------------------------------------


def _div_if_needed(tensor: torch.Tensor, factor: float) -> None:
    # Mirrors FSDP's ``_div_if_needed``: a factor of 1 is skipped, not divided by.
    if factor > 1:
        tensor.div_(factor)


# ---------------------------------------------------------------------------
# Known-good hooks
# ---------------------------------------------------------------------------


class NativeAveragingHook:
    """Reproduces FSDP1's full-precision averaging exactly, as a callable object.

    Right: pre-divide by ``state.gradient_predivide_factor``, SUM ``all_reduce`` (``NO_SHARD``,
    in place on ``grad``) or SUM ``reduce_scatter_single`` into ``output`` (sharded), then
    post-divide, with the same ``> 1`` guards as ``_div_if_needed``. Realistic: hooks are
    often objects carrying configuration (a logger, a custom transport) around this core.
    """

    def __call__(self, state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        _div_if_needed(grad, state.gradient_predivide_factor)
        if output is None:
            dist.all_reduce(grad, group=state.process_group)
            _div_if_needed(grad, state.gradient_postdivide_factor)
        else:
            _reduce_scatter(output, grad, state.process_group)
            _div_if_needed(output, state.gradient_postdivide_factor)


def async_wait_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Native full-precision averaging with ``async_op=True`` collectives and ``.wait()``.

    Right: identical arithmetic to the native path; the only change is that the collective
    returns a work handle that is waited on before the post-divide. Realistic: hooks that
    overlap communication with other work are written this way, and forgetting the wait
    is a classic bug this hook does not have.
    """
    _div_if_needed(grad, state.gradient_predivide_factor)
    if output is None:
        work = dist.all_reduce(grad, group=state.process_group, async_op=True)
        work.wait()
        _div_if_needed(grad, state.gradient_postdivide_factor)
    else:
        work = _reduce_scatter(output, grad, state.process_group, async_op=True)
        work.wait()
        _div_if_needed(output, state.gradient_postdivide_factor)


def _reduce_in(dtype: torch.dtype, state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor]) -> None:
    """FSDP's ``MixedPrecision(reduce_dtype=dtype)`` reduction, with the result cast back.

    Rounding points, in the native order: ``grad -> dtype`` (``_post_backward_hook``),
    pre-divide in ``dtype``, SUM collective in ``dtype``, post-divide in ``dtype``, then an
    exact widening cast to the incoming dtype (``_cast_grad_to_param_dtype``). Casting after
    the pre-divide instead would round twice near the subnormal range.
    """
    low = grad.to(dtype)
    _div_if_needed(low, state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(low, group=state.process_group)
        _div_if_needed(low, state.gradient_postdivide_factor)
        grad.copy_(low)
    else:
        low_out = torch.empty(output.shape, dtype=dtype, device=output.device)
        _reduce_scatter(low_out, low, state.process_group)
        _div_if_needed(low_out, state.gradient_postdivide_factor)
        output.copy_(low_out)


def fp16_portable_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """fp16 compression equal to ``MixedPrecision(reduce_dtype=torch.float16)``, CPU-portable.

    Right: casts to fp16 before the pre-divide, reduces and post-divides in fp16, and writes
    the result back in the parameter dtype (``grad.copy_``/``output.copy_``) instead of
    PyTorch's ``_decompress``, whose ``record_stream`` raises on CPU. Realistic: this is
    what a user writes after the built-in ``fp16_compress_hook`` fails on a CPU test rig.
    """
    _reduce_in(torch.float16, state, grad, output)


def bf16_portable_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """bf16 compression equal to ``MixedPrecision(reduce_dtype=torch.bfloat16)``, CPU-portable.

    Right: same rounding points as the native mixed-precision path, in bf16, cast back to
    the parameter dtype without ``record_stream``. Realistic: the bf16 twin of the fp16 hook.
    """
    _reduce_in(torch.bfloat16, state, grad, output)


class AveragingState:
    """A user-defined hook state: the process group and the two averaging factors.

    ``__slots__`` as in PyTorch's ``DefaultState``, so a typo'd attribute raises instead of
    silently creating a new one. Built by :func:`make_state`.
    """

    __slots__ = ("process_group", "world_size", "predivide", "postdivide")

    def __init__(self, process_group: Any, world_size: int, predivide: float, postdivide: float) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.predivide = predivide
        self.postdivide = postdivide


def make_state(process_group: Any) -> AveragingState:
    """State factory, called by the suite as ``make_state(process_group)`` on every rank.

    Computes the pre-divide factor the way ``DefaultState._get_gradient_predivide_factor``
    does (start at 1, double while it divides ``world_size`` and is below
    ``world_size / factor``: 2 at 2, 3 and 4 ranks, 4 at 8), so the divisions match FSDP's.
    """
    world_size = dist.get_world_size(process_group)
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    predivide = float(factor)
    return AveragingState(process_group, world_size, predivide, world_size / predivide)


def custom_state_hook(state: AveragingState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Native full-precision averaging that reads its factors from a user-defined state.

    Right: same operations as FSDP's default path, with the factors from
    :class:`AveragingState`. Realistic: users bring their own state class rather than
    subclassing PyTorch's private ``DefaultState``; this exercises the ``state=`` factory.
    """
    _div_if_needed(grad, state.predivide)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        _div_if_needed(grad, state.postdivide)
    else:
        _reduce_scatter(output, grad, state.process_group)
        _div_if_needed(output, state.postdivide)


# ---------------------------------------------------------------------------
# Known-bad hooks
# ---------------------------------------------------------------------------


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


def wrong_shard_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Wrong (sharded only): averages correctly but keeps the shard of rank ``(rank + 1) % ws``.

    All-reduces the whole padded gradient with the native pre/post-divide, then copies the
    neighbour's chunk into ``output``. Realistic: an off-by-one in the chunk index of a
    hand-rolled reduce-scatter (all-reduce + slice), e.g. counting ranks from 1.
    """
    ws = dist.get_world_size(state.process_group)
    rank = dist.get_rank(state.process_group)
    _div_if_needed(grad, state.gradient_predivide_factor)
    dist.all_reduce(grad, group=state.process_group)
    _div_if_needed(grad, state.gradient_postdivide_factor)
    output.copy_(grad.chunk(ws)[(rank + 1) % ws])


class ReplayState(DefaultState):
    """``DefaultState`` plus the buffers of :class:`StaleCachedReduce`, fresh per model."""

    __slots__ = ("replay", "position", "round_open")

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.replay: Dict[Any, torch.Tensor] = {}
        self.position = 0
        self.round_open = False


class StaleCachedReduce:
    """Wrong: caches the first reduced result per call position and replays it afterwards.

    The first backward is reduced natively and each result is saved under its call position
    (the index of the call within the backward, reset at the end of every backward pass by
    an autograd-engine callback); from the second backward on the saved result is copied out
    and nothing is communicated. Outside a backward pass the position is the gradient's size.
    Realistic: a persistent communication buffer that was meant to be refilled each step,
    or a memoisation added for benchmarking and never removed. Only a multi-step check sees it.
    """

    def __call__(self, state: ReplayState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        key = self._position(state, grad, output)
        target = grad if output is None else output
        cached = state.replay.get(key)
        if cached is not None and cached.shape == target.shape and cached.dtype == target.dtype:
            target.copy_(cached)
            return
        NativeAveragingHook()(state, grad, output)
        state.replay[key] = target.detach().clone()

    @staticmethod
    def _position(state: ReplayState, grad: torch.Tensor, output: Optional[torch.Tensor]) -> Any:
        sizes = (grad.numel(), None if output is None else output.numel())
        if not state.round_open:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: StaleCachedReduce._end_round(state)
                )
            except RuntimeError:  # not inside a backward pass
                return sizes
            state.round_open = True
        position = state.position
        state.position += 1
        return (position,) + sizes

    @staticmethod
    def _end_round(state: ReplayState) -> None:
        state.position = 0
        state.round_open = False


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


def local_only_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: never communicates; each rank keeps its own local gradient (divided by 1).

    ``NO_SHARD`` leaves ``grad`` as is; sharded copies this rank's own chunk of the local
    gradient into ``output``. Passes any check whose inputs are the same on every rank.
    Realistic: a hook whose collective is behind a flag (``if self.enabled``) that is off,
    or a single-process debugging stub left registered.
    """
    if output is None:
        grad.div_(1)
    else:
        ws = dist.get_world_size(state.process_group)
        rank = dist.get_rank(state.process_group)
        output.copy_(grad.chunk(ws)[rank])


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


def default_group_hook(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: FSDP's averaging, but over the default group instead of ``state.process_group``.

    Realistic: ``dist.all_reduce(grad)`` with the group argument forgotten. Right whenever FSDP
    runs on WORLD, which every other case does; on a data-parallel subgroup it mixes the
    groups' gradients (``NO_SHARD``) or reduce-scatters over the wrong ranks (sharded).
    """
    _div_if_needed(grad, state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(grad)
        _div_if_needed(grad, state.gradient_postdivide_factor)
    else:
        _reduce_scatter(output, grad, None)
        _div_if_needed(output, state.gradient_postdivide_factor)


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


# ---------------------------------------------------------------------------
# Lossy by design (declared with a LossyContract)
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------

KNOWN_GOOD: List[HookSpec] = [
    HookSpec(
        name="good_callable_object",
        api="fsdp",
        hook=NativeAveragingHook(),
        state=DefaultState,
        description="callable object: native pre-divide, SUM all_reduce/reduce_scatter, post-divide",
    ),
    HookSpec(
        name="good_async_wait",
        api="fsdp",
        hook=async_wait_hook,
        state=DefaultState,
        description="native averaging with async_op=True collectives and work.wait()",
    ),
    HookSpec(
        name="good_fp16_portable",
        api="fsdp",
        hook=fp16_portable_hook,
        state=LowPrecisionState,
        reduce_dtype=torch.float16,
        description="fp16 reduce equal to MixedPrecision(reduce_dtype=float16), cast back without record_stream",
    ),
    HookSpec(
        name="good_bf16_portable",
        api="fsdp",
        hook=bf16_portable_hook,
        state=LowPrecisionState,
        reduce_dtype=torch.bfloat16,
        description="bf16 reduce equal to MixedPrecision(reduce_dtype=bfloat16), cast back without record_stream",
    ),
    HookSpec(
        name="good_state_factory",
        api="fsdp",
        hook=custom_state_hook,
        state=make_state,
        description="native averaging with a user-defined __slots__ state built by make_state(process_group)",
    ),
]

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
        name="bad_wrong_shard",
        api="fsdp",
        hook=wrong_shard_hook,
        state=DefaultState,
        strategies=_SHARDED,
        description="correct average, but output gets the shard of rank (rank + 1) % world_size",
    ),
    HookSpec(
        name="bad_stale_after_first_step",
        api="fsdp",
        hook=StaleCachedReduce(),
        state=ReplayState,
        description="replays the first step's reduced gradients from the second step on",
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
        name="bad_local_only",
        api="fsdp",
        hook=local_only_hook,
        state=DefaultState,
        description="never communicates: every rank keeps its local gradient",
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
]

KNOWN_BAD.append(HookSpec(name="bad_sum_then_divide", api="fsdp", hook=sum_then_divide_hook, state=DefaultState,
                          description="SUM then / world_size: FSDP's rounding, but overflows where FSDP pre-divides"))
KNOWN_BAD.append(HookSpec(name="bad_default_group", api="fsdp", hook=default_group_hook, state=DefaultState,
                          description="native averaging over the default group, not the state's process group"))
KNOWN_BAD.append(HookSpec(name="bad_nan_to_zero", api="fsdp", hook=nan_to_zero_hook, state=DefaultState,
                          description="native average, then NaN and +/-Inf replaced by zero"))
KNOWN_BAD.append(HookSpec(name="bad_fp32_accumulate", api="fsdp", hook=fp32_accumulate_hook, state=DefaultState,
                          description="FSDP's averaging always in float32, even on float16 gradients"))

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

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

#: The lossy-contract story (``tests/meta_zoos.py``'s ``LOSSY``, and ``tests/test_meta_lossy.py``).
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

#: For each known-bad spec, the check that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_nan_to_zero": "hard_inputs: NaN on one rank and +Inf against -Inf come back as zeros",
    "bad_sum_then_divide": (
        "hard_inputs: near float32's max the undivided SUM overflows to inf where FSDP's pre-divided one "
        "stays finite; elsewhere it rounds exactly as FSDP, so averaging and parity pass"
    ),
    "bad_fp32_accumulate": (
        "clip_grad_norm_low_precision at 3 ranks only: the one case with float16 gradients (MixedPrecision(param_dtype="
        "float16, reduce_dtype=float16), kept low precision), which FSDP reduces in float16 and the hook in float32 (at 2 ranks the float16 sum of two pre-divided values is exact, so both agree)"
    ),
    "bad_default_group": (
        "subgroup_parity only: every other case trains on WORLD, where the default group is the right one"
    ),
    "bad_sum_no_average": (
        "averaging: every element is sum(0..ws-1), ws times the mean; parity fails too"
    ),
    "bad_divide_after": (
        "hard_inputs: near-65504 fp16 grads make the undivided fp16 sum overflow to inf where "
        "FSDP's pre-divided sum stays finite (odd multiples of the fp16 subnormal step also "
        "round differently); on ordinary values it is bitwise equal to MixedPrecision(float16) "
        "at 2 and 3 ranks (sum/ws rounds like (sum/pre)/post), so averaging and parity pass"
    ),
    "bad_wrong_shard": (
        "parity (sharded): each rank's gradient shard holds its neighbour's values; averaging "
        "cannot see it because Linear(1, ws) has equal gradient elements in every shard"
    ),
    "bad_stale_after_first_step": (
        "parity: step 1 is bitwise native, from step 2 on the replayed step-1 gradients differ "
        "(a single-step check passes it)"
    ),
    "bad_no_cast_back": (
        "parity, hook-output dtype check: the hook hands back float16 instead of the param "
        "dtype; the final gradients are right because FSDP1 casts them back itself"
    ),
    "bad_local_only": (
        "averaging: with input=rank each rank keeps its own gradient, not the mean; parity and "
        "rank_consistency (NO_SHARD) fail too"
    ),
    "bad_power_of_two_divisor": (
        "averaging and parity at world size 3 (divides by 4); bitwise equal to native at 2 and 4, "
        "so a suite that never runs 3 ranks passes it"
    ),
    "bad_rank0_only_noise": (
        "parity: rank 0's gradients are one ULP above native; rank_consistency (NO_SHARD): "
        "rank 0 differs from the other ranks; averaging fails on rank 0 too (exact compare)"
    ),
}
