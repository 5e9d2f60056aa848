"""The FSDP1 zoo's known-good hooks, each with its ``HookSpec``: FSDP1's own averaging as a callable object, with
async collectives and through a state of the user's own, and the float16 and bfloat16 reductions of
``MixedPrecision``, cast back without ``record_stream``; and the collectives' helpers the other modules of the
zoo share. ``tests/zoo/fsdp_hooks/__init__.py`` says what "good" means for FSDP1.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import (
    DefaultState,
    LowPrecisionState,
)

from conformance.spec import HookSpec
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter


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
