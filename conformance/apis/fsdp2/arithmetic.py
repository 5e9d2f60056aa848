"""FSDP2's native reduction, as a comm or an all-reduce hook sees it, for the diagnosis (an FSDP2 extra).

* A custom reduce-scatter comm performs exactly the collective FSDP2 asks for,
  ``reduce_scatter_tensor(output, input, op=op, group=group)`` on the
  reduce-dtype buffer FSDP2 filled (``foreach_reduce``); FSDP2 does any pre- and
  post-division itself (:class:`CommArithmetic`). A comm that averages by hand
  where FSDP2 asks for ``AVG`` picks its own divisor, so one read off the
  default group (``dist.get_world_size()``) under HSDP or on a subgroup is named.
* An all-reduce hook runs after native HSDP has reduced the gradient
  (``foreach_reduce`` calls it on the result), so native is the tensor unchanged,
  and the causes are the mesh's sizes a hook might divide by again, or a second
  reduction over the default group (:class:`AllReduceHookArithmetic`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.apis.fsdp2.recorders import op_name
from conformance.ranks.arithmetic import Arithmetic, Candidate
from conformance.ranks.reduction import ALL_REDUCE, NO_COLLECTIVE, REDUCE_SCATTER, Reduction, Scale


@dataclasses.dataclass(frozen=True)
class CommArithmetic(Arithmetic):
    """The collective FSDP2 asks a comm for. ``op``: the ``ReduceOp`` it passed (set per call by
    :meth:`for_call`, from the recorded call)."""

    op: Any = None

    def reduction(self, call: Any) -> Reduction:
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

    def where_result_goes(self, call: Any) -> str:
        return "reduce into the output_tensor FSDP2 passes the comm (FSDP2's gradients are views of it)"

    def wrong_world_sizes(self) -> Sequence[int]:
        """None: FSDP2 divides itself, and the op the comm got says how; no world size is the comm's to pick."""
        return ()

    def for_call(self, call: Any) -> "CommArithmetic":
        """Over the group, and with the op, FSDP2 passed the comm in that call."""
        return self if call.group is None else dataclasses.replace(self, world_size=call.group.size(), op=call.op)


@dataclasses.dataclass(frozen=True)
class AllReduceHookArithmetic(Arithmetic):
    """Native HSDP's (or ``replicate``'s) already reduced gradient, left as it is. ``divisors``: the mesh's sizes
    (replicate, shard, world) a hook might divide it by again."""

    divisors: Tuple[int, ...] = ()
    #: What reduced the gradient before the hook: ``"native HSDP"``, or ``"replicate"``.
    native_name: str = "native HSDP"
    hook_picks_divisor = False  # the mesh's sizes, the world's among them, are in ``divisors``

    def reduction(self, call: Any) -> Reduction:
        """No collective: the tensor is native HSDP's already."""
        return Reduction(collective=NO_COLLECTIVE)

    def describe(self) -> str:
        return f"{self.native_name} hands the hook its already reduced gradient, to leave as it is"

    group_arg = "group=<the replicate group>"

    def how_to_average(self) -> str:
        return f"leave the tensor as {self.native_name} hands it to the hook: already reduced and averaged"

    def where_result_goes(self, call: Any) -> str:
        return "change the tensor FSDP2 passes the hook in place, if at all (FSDP2 ignores the return value)"

    def native_result(self, call: Any, group: Any) -> torch.Tensor:
        return call.input.to(call.output.dtype)

    def unreduced(self, call: Any, rank: int) -> torch.Tensor:
        """Native itself: the hook's input is reduced already."""
        return call.input.to(call.output.dtype)

    def candidates(self, call: Any, group: Any, rank: int) -> List[Candidate]:
        x = call.input.to(call.output.dtype)
        out: List[Candidate] = [Candidate("native", x.clone())]
        for d in sorted(set(self.divisors)):
            out.append(Candidate(f"divided by {d} after {self.native_name} had already averaged it", x.div(d),
                                 f"drop the division by {d}: {self.how_to_average()}"))
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        again = (f"drop the all-reduce: {self.how_to_average()} (a collective with no group= runs over every rank "
                 "of the default group, whose shards differ)")
        out.append(Candidate("all-reduced (SUM) again over the default group, mixing the shards of different ranks",
                             summed, again))
        out.append(Candidate("averaged again over the default group, mixing the shards of different ranks",
                             summed.div(self.world_size), again))
        return out
