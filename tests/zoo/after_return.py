"""FSDP1 hooks whose own result is native's in every call, for the default-hook replay's tests.

The diagnosis of both says "what differs arose after the hook returned"; only
PyTorch's own default hook, replayed on the case, tells them apart
(``conformance/controller/default_replay.py``, ``tests/test_default_replay.py``):

* ``good_native_copy``: FSDP's native averaging (the zoo's ``NativeAveragingHook``),
  a user's hook like any other: wherever it fails, the default hook fails alike;
* ``bad_scales_previous_output``: averages natively, then, at its next call,
  scales the shard it returned before by ``1 + 2**-10``: the shard FSDP keeps as
  that unit's gradient, changed after the hook returned. Its difference is its own.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec
from tests.zoo.fsdp_hooks import NativeAveragingHook

#: What the bad hook multiplies the previous shard by: far beyond any rounding, so its difference shows
#: in every view, whatever else differs.
SCALE = 1 + 2 ** -10


class PreviousOutputState(DefaultState):
    """``DefaultState`` plus the shard the hook returned last (per model: a fresh state per registration)."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.previous: Optional[torch.Tensor] = None


def scales_previous_output_hook(state: PreviousOutputState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Wrong: native reduce-scatter averaging, then the previous call's shard scaled after that call returned."""
    NativeAveragingHook()(state, grad, output)
    if state.previous is not None:
        state.previous.mul_(SCALE)
    state.previous = output


ALL: List[HookSpec] = [
    HookSpec(name="good_native_copy", api="fsdp", hook=NativeAveragingHook(), state=DefaultState,
             strategies=("FULL_SHARD",), description="native averaging, a user's copy"),
    HookSpec(name="bad_scales_previous_output", api="fsdp", hook=scales_previous_output_hook,
             state=PreviousOutputState, strategies=("FULL_SHARD",),
             description="native averaging, then the previous shard scaled after the hook returned"),
]
