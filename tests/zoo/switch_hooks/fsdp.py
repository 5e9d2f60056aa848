"""The switch zoo's FSDP1 hooks, ``hook(state, grad)`` (``NO_SHARD``) and ``hook(state, grad, output)`` (sharded): a
path taken only where two switches hold at once, a warm-up and a large flat gradient, or several nodes and a
large flat gradient (``tests/zoo/switch_hooks/__init__.py`` says what the zoo holds). The line that decides each
one's other path ends in ``# switch``.
"""

from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _fsdp_in, _fsdp_native, _UnitCalls, topology

#: Calls per FSDP unit of FSDP's own averaging before the other path may start.
FSDP_WARMUP_STEPS = 80
#: Flat gradients of this many elements and more take the other path (4 MiB of float32).
FSDP_LARGE_NUMEL = 2 ** 20


class FsdpSwitchState(DefaultState):
    """``DefaultState`` (the process group and FSDP's pre/post-divide factors) and a call count per unit (keyed by
    the unit's gradient size: a hook sees no unit identity), fresh per model."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.units = _UnitCalls()


def bad_fsdp_warm_large_fp16(state, grad, output=None):
    """Once a unit is warmed up (80 calls), large flat gradients (2**20 elements and more) are reduced in float16
    (``MixedPrecision(reduce_dtype=float16)``'s arithmetic); everything else FSDP's averaging. Claims full
    precision."""
    warm = state.units.step_of(grad.numel()) >= FSDP_WARMUP_STEPS
    if warm and grad.numel() >= FSDP_LARGE_NUMEL:  # switch
        _fsdp_in(torch.float16, state, grad, output)
    else:
        _fsdp_native(state, grad, output)


def good_fsdp_warm_large_async(state, grad, output=None):
    """Once a unit is warmed up (80 calls), large flat gradients (2**20 elements and more) are reduced with
    ``async_op=True`` and a wait; FSDP's arithmetic on every path."""
    if state.units.step_of(grad.numel()) >= FSDP_WARMUP_STEPS:
        if grad.numel() >= FSDP_LARGE_NUMEL:  # switch
            _fsdp_native(state, grad, output, async_op=True)
            return
    _fsdp_native(state, grad, output)


def bad_fsdp_nodes_large_fp16(state, grad, output=None):
    """Across nodes, large flat gradients (2**20 elements and more) are reduced in float16 to spare the slow link;
    everything else FSDP's averaging. Claims full precision."""
    _, nodes, _, _ = topology(dist.get_world_size())
    if nodes > 1 and grad.numel() >= FSDP_LARGE_NUMEL:  # switch
        _fsdp_in(torch.float16, state, grad, output)
        return
    _fsdp_native(state, grad, output)


def good_fsdp_nodes_large_async(state, grad, output=None):
    """Across nodes, large flat gradients (2**20 elements and more) are reduced with ``async_op=True`` and a wait,
    where a real hook overlaps the slow link; FSDP's arithmetic on every path."""
    _, nodes, _, _ = topology(dist.get_world_size())
    if nodes > 1 and grad.numel() >= FSDP_LARGE_NUMEL:  # switch
        _fsdp_native(state, grad, output, async_op=True)
        return
    _fsdp_native(state, grad, output)


def _fsdp(name: str, hook: Any, description: str, **kwargs: Any) -> HookSpec:
    return HookSpec(name=name, api="fsdp", hook=hook, state=FsdpSwitchState, description=description, **kwargs)


KNOWN_GOOD: List[HookSpec] = [
    _fsdp("good_fsdp_warm_large_async", good_fsdp_warm_large_async,
          "after 80 calls per unit, flat gradients >= 2**20 elements async and waited on: FSDP's arithmetic"),
    _fsdp("good_fsdp_nodes_large_async", good_fsdp_nodes_large_async,
          "across nodes, flat gradients >= 2**20 elements async and waited on: FSDP's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _fsdp("bad_fsdp_warm_large_fp16", bad_fsdp_warm_large_fp16,
          "after 80 calls per unit, flat gradients >= 2**20 elements in float16, claiming full precision"),
    _fsdp("bad_fsdp_nodes_large_fp16", bad_fsdp_nodes_large_fp16,
          "across nodes, flat gradients >= 2**20 elements in float16, claiming full precision"),
]
