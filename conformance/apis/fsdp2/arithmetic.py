"""FSDP2's native reduction, as a custom reduce-scatter comm sees it, for the diagnosis.

A custom reduce-scatter comm performs exactly the collective FSDP2 asks for,
``reduce_scatter_tensor(output, input, op=op, group=group)`` on the
reduce-dtype buffer FSDP2 filled (``foreach_reduce``); FSDP2 does any pre- and
post-division itself (:class:`CommArithmetic`). A comm that averages by hand where
FSDP2 asks for ``AVG`` picks its own divisor, so one read off the default group
(``dist.get_world_size()``) under HSDP or on a subgroup is named. An all-reduce hook's is
:class:`~conformance.apis.fsdp2_all_reduce.arithmetic.AllReduceHookArithmetic`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import torch

from conformance.apis.fsdp2.recorder import op_name
from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.reduction import ALL_REDUCE, REDUCE_SCATTER, Reduction, Scale
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.hook_call import HookCall


@dataclasses.dataclass(frozen=True)
class CommArithmetic(Arithmetic):
    """The collective FSDP2 asks a comm for. ``op``: the ``ReduceOp`` it passed (set per call by
    :meth:`for_call`, from the recorded call)."""

    op: Any = None

    def reduction(self, call: HookCall) -> Reduction:
        """The collective FSDP2 asked for, with its op, in the buffer's dtype. Dividing as for another world size
        than the group's (:meth:`dividing_as`), an ``AVG`` is a SUM divided by that size: what a comm that
        averages by hand computes; a SUM or ``PREMUL_SUM`` stays as asked (FSDP2 divides itself)."""
        collective = REDUCE_SCATTER if call.sharded else ALL_REDUCE
        group_size = call.group.size() if call.group is not None else self.world_size
        if self.world_size != group_size and op_name(self.op) == "AVG":
            return Reduction(post=(Scale(self.world_size),), dtype=self.reduce_dtype, collective=collective)
        return Reduction(op=self.op, dtype=self.reduce_dtype, collective=collective)

    def describe(self) -> str:
        return f"FSDP2 asked the comm for op={op_name(self.op)} over {self.world_size} ranks"

    group_arg = "group=group (the group FSDP2 passes the comm)"

    def how_to_average(self) -> str:
        return (f"reduce-scatter with the op FSDP2 passes the comm (here op={op_name(self.op)}) over the group it "
                "passes, and divide nothing yourself (FSDP2 divides before and after the comm where it asks for SUM)")

    def where_result_goes(self, call: HookCall) -> str:
        return "reduce into the output_tensor FSDP2 passes the comm (FSDP2's gradients are views of it)"

    def why_not_rounded(self, narrow: torch.dtype, given: torch.dtype) -> str:
        """FSDP2 hands the comm the gradients in the reduce dtype; with ``narrow`` parameters they hold ``narrow``
        values after one micro-batch only: it accumulates unsharded gradients in the reduce dtype (PyTorch PR
        125191), so under gradient accumulation the comm gets their sums."""
        low, own = dtype_name(narrow), dtype_name(given)
        return (f"FSDP2 hands the comm its gradients in {own}; with param_dtype={low} they hold {low} values after "
                f"one micro-batch only: under gradient accumulation FSDP2 accumulates them in the reduce dtype and "
                f"hands the comm {own} sums (PyTorch PR 125191)")

    def wrong_world_sizes(self) -> Sequence[int]:
        """None: FSDP2 divides itself, and the op the comm got says how; no world size is the comm's to pick."""
        return ()

    def for_call(self, call: HookCall) -> "CommArithmetic":
        """Over the group, and with the op, FSDP2 passed the comm in that call."""
        return self if call.group is None else dataclasses.replace(self, world_size=call.group.size(), op=call.op)
