"""FSDP2's native reduction, as a custom reduce-scatter comm sees it, for the diagnosis.

A custom reduce-scatter comm performs exactly the collective FSDP2 asks for,
``reduce_scatter_tensor(output, input, op=op, group=group)`` on the
reduce-dtype buffer FSDP2 filled (``foreach_reduce``); FSDP2 does any pre- and
post-division itself (:class:`CommArithmetic`). An all-reduce hook's is
:class:`~conformance.apis.fsdp2_all_reduce.arithmetic.AllReduceHookArithmetic`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from conformance.apis.fsdp2.recorder import op_name
from conformance.ranks.arithmetic import Arithmetic, reduced


@dataclasses.dataclass(frozen=True)
class CommArithmetic(Arithmetic):
    """The collective FSDP2 asks a comm for. ``op``: the ``ReduceOp`` it passed (set per call by
    :meth:`for_call`, from the recorded call)."""

    op: Any = None
    hook_picks_divisor = False

    def reduce(self, t: torch.Tensor, cast: bool, call: Any, group: Any, group_size: int,
               shift: int) -> torch.Tensor:
        return reduced(t, call, group, group_size, shift, op=self.op)

    def describe(self) -> str:
        return f"FSDP2 asked the comm for op={op_name(self.op)} over {self.world_size} ranks"

    group_arg = "group=group (the group FSDP2 passes the comm)"

    def how_to_average(self) -> str:
        return (f"reduce-scatter with the op FSDP2 passes the comm (here op={op_name(self.op)}) over the group it "
                "passes, and divide nothing yourself (FSDP2 divides before and after the comm where it asks for SUM)")

    def where_result_goes(self, call: Any) -> str:
        return "reduce into the output_tensor FSDP2 passes the comm (FSDP2's gradients are views of it)"

    def wrong_world_sizes(self) -> Sequence[int]:
        """None: FSDP2 divides itself, and the op the comm got says how; no world size is the comm's to pick."""
        return ()

    def for_call(self, call: Any) -> "CommArithmetic":
        """Over the group, and with the op, FSDP2 passed the comm in that call."""
        return self if call.group is None else dataclasses.replace(self, world_size=call.group.size(), op=call.op)
