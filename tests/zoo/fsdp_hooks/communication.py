"""The FSDP1 zoo's known-bad hooks that reduce the wrong thing: a neighbour's shard, the first step's result
replayed, no communication at all, the default group instead of the state's; each with its ``HookSpec`` and what
must catch it (``EXPECTED_CATCH``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec
from tests.zoo.fsdp_hooks.good import NativeAveragingHook, _div_if_needed
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter

_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


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


KNOWN_BAD: List[HookSpec] = [
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
        name="bad_local_only",
        api="fsdp",
        hook=local_only_hook,
        state=DefaultState,
        description="never communicates: every rank keeps its local gradient",
    ),
    HookSpec(name="bad_default_group", api="fsdp", hook=default_group_hook, state=DefaultState,
             description="native averaging over the default group, not the state's process group"),
]

#: For each known-bad spec here: the check that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_wrong_shard": (
        "parity (sharded): each rank's gradient shard holds its neighbour's values; averaging "
        "cannot see it because Linear(1, ws) has equal gradient elements in every shard"
    ),
    "bad_stale_after_first_step": (
        "parity: step 1 is bitwise native, from step 2 on the replayed step-1 gradients differ "
        "(a single-step check passes it)"
    ),
    "bad_local_only": (
        "averaging: with input=rank each rank keeps its own gradient, not the mean; parity and "
        "rank_consistency (NO_SHARD) fail too"
    ),
    "bad_default_group": (
        "subgroup_parity only: every other case trains on WORLD, where the default group is the right one"
    ),
}
