"""Native HSDP's replica reduction, as a replica all-reduce hook must reproduce it, for the diagnosis.

On a 1-D shard mesh FSDP2 reduce-scatters over the shard group (averaging over
it) and does no all-reduce of its own; it hands the hook the reduce-scatter
output. Native HSDP on the 2-D (replicate x shard) mesh of the same ranks then
all-reduces that output over the replica group with ``ReduceOp.AVG``
(``_get_gradient_divide_factors`` for float32 and bfloat16): the SUM over the
replicas divided by their number, which the hook's result must equal.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.reduction import ALL_REDUCE, Reduction, Scale

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.hook_call import HookCall


@dataclasses.dataclass(frozen=True)
class ReplicaArithmetic(Arithmetic):
    """The AVG all-reduce over ``world_size`` replicas (the replica group, which the recorder gives each call).

    A hook picks its own divisor here, so one read off the default group (``dist.get_world_size()``: every
    rank of the mesh, not the replicas) is a named cause.
    """

    hook_picks_divisor = True

    def reduction(self, call: HookCall) -> Reduction:
        """A SUM all-reduce over the replica group, divided by the replica count (gloo's ``AVG``)."""
        return Reduction(post=(Scale(self.world_size),), dtype=self.reduce_dtype, collective=ALL_REDUCE)

    def describe(self) -> str:
        return f"native HSDP averages over the {self.world_size} replicas (ReduceOp.AVG)"

    group_arg = "group=group (the replica group the hook is given)"

    def how_to_average(self) -> str:
        return (f"all-reduce the tensor over the replica group the hook is given with op=ReduceOp.AVG (the SUM "
                f"divided by the {self.world_size} replicas), as native HSDP does")

    def where_result_goes(self, call: HookCall) -> str:
        return "all-reduce the tensor FSDP2 passes the hook in place (FSDP2 ignores the return value)"
