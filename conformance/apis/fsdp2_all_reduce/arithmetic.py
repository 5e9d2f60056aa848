"""FSDP2's native reduction, as an all-reduce hook sees it, for the diagnosis.

An all-reduce hook runs after native HSDP (or ``replicate``) has reduced the
gradient (``foreach_reduce`` calls it on the result), so native is the tensor
unchanged, and the causes are the mesh's sizes a hook might divide by again, a
second reduction over the default group, or the tensor rounded to a narrower
dtype and back (:class:`AllReduceHookArithmetic`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist

from conformance.protocol import Cause
from conformance.ranks.arithmetic import Arithmetic, Candidate, narrower_than
from conformance.ranks.reduction import NO_COLLECTIVE, Reduction, rounded
from conformance.shared.compare import same_bits
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.hook_call import HookCall


@dataclasses.dataclass(frozen=True)
class AllReduceHookArithmetic(Arithmetic):
    """Native HSDP's (or ``replicate``'s) already reduced gradient, left as it is. ``divisors``: the mesh's sizes
    (replicate, shard, world) a hook might divide it by again."""

    divisors: Tuple[int, ...] = ()
    #: What reduced the gradient before the hook: ``"native HSDP"``, or ``"replicate"``.
    native_name: str = "native HSDP"
    hook_picks_divisor = False  # the mesh's sizes, the world's among them, are in ``divisors``

    def reduction(self, call: HookCall) -> Reduction:
        """No collective: the tensor is native HSDP's already."""
        return Reduction(collective=NO_COLLECTIVE)

    def describe(self) -> str:
        return f"{self.native_name} hands the hook its already reduced gradient, to leave as it is"

    group_arg = "group=<the replicate group>"

    def how_to_average(self) -> str:
        return f"leave the tensor as {self.native_name} hands it to the hook: already reduced and averaged"

    def where_result_goes(self, call: HookCall) -> str:
        return "change the tensor FSDP2 passes the hook in place, if at all (FSDP2 ignores the return value)"

    def why_not_rounded(self, narrow: torch.dtype, given: torch.dtype) -> str:
        low, own = dtype_name(narrow), dtype_name(given)
        return (f"{self.native_name} hands the hook a {own} average over ranks, which holds {own} values that {low} "
                "rounds, whatever the parameter dtype")

    def native_result(self, call: HookCall, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        return call.input.to(call.output.dtype)

    def unreduced(self, call: HookCall, rank: int) -> torch.Tensor:
        """Native itself: the hook's input is reduced already."""
        return call.input.to(call.output.dtype)

    def candidates(self, call: HookCall, group: Optional[dist.ProcessGroup], rank: int) -> List[Candidate]:
        x = call.input.to(call.output.dtype)
        out: List[Candidate] = [Candidate(Cause("native", words="native"), x.clone())]
        for d in sorted(set(self.divisors)):
            out.append(Candidate(Cause("divided_twice", (("how", "divide"), ("divisor", d)),
                                       f"divided by {d} after {self.native_name} had already averaged it",
                                       f"drop the division by {d}: {self.how_to_average()}"), x.div(d)))
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        again = (f"drop the all-reduce: {self.how_to_average()} (a collective with no group= runs over every rank "
                 "of the default group, whose shards differ)")
        out.append(Candidate(Cause("reduced_again", (("averaged", False),), "all-reduced (SUM) again over the default "
                                   "group, mixing the shards of different ranks", again), summed))
        out.append(Candidate(Cause("reduced_again", (("averaged", True),), "averaged again over the default group, "
                                   "mixing the shards of different ranks", again), summed.div(self.world_size)))
        # Rounded to a narrower dtype and back (the shared cause, worded as for an API that reduced already):
        # named only where it changes this rank's tensor. No collective, so the choice is this rank's own.
        words, native = self.words(call, rank), self.reduction(call)
        for narrow in narrower_than(call.input.dtype, call.input.dtype):
            value = rounded(x, narrow)
            if not same_bits(value, x):
                out.append(Candidate(words.of(native, dataclasses.replace(native, rounded_to=narrow)), value))
        return out
