"""The words of a candidate cause and of the fix it implies, from the fields it changes in native's reduction.

A candidate cause is native's :class:`~conformance.ranks.reduction.Reduction`
with one or two fields changed. :meth:`Words.of` names it from that change,
field by field, most telling first:

* ``collective`` (an all-reduce and a chunk, where native reduce-scatters) and
  ``read`` (another rank's shard): which values this rank kept;
* ``group`` (the divisor read off the default group) and ``divides_as`` (the
  divisors of another world size): which group the hook divided as for;
* ``dtype``: native's arithmetic in another dtype than the one claimed;
* ``rounded_to``: the input rounded to a narrower dtype (cast to it and back)
  before an otherwise native reduction, as a hook that stages it in a narrower
  buffer, or assumes it holds that dtype's values, does;
* ``pre``, ``op``, ``post`` and ``order``, worded together as the arithmetic the
  hook did: "SUM, then divided by 3", "summed in rank order (rank 0 + rank 1 +
  rank 2), then multiplied by 1/3", "averaged twice".

Each comes with its fix, one instruction worded for the API by what its
arithmetic states (:class:`Words`: how native averages, how the hook names its
process group). This module knows no API and recomputes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

import torch

from conformance.ranks.reduction import (ALL_REDUCE_THEN_CHUNK, DEFAULT_GROUP, NO_COLLECTIVE, PAIRWISE, RANK, RING,
                                         THE_COLLECTIVES, Reduction, Scale, pairwise_text)
from conformance.ulps import dtype_name

__all__ = ["Words"]

#: How a fix names each summation order a hook may compute itself.
_ORDER_NAMES = {RANK: "rank order", RING: "ring order", PAIRWISE: "pairwise (tree) order"}


def _words(steps: Sequence[Scale]) -> str:
    return " and ".join(s.words() for s in steps)


@dataclasses.dataclass(frozen=True)
class Words:
    """What one call's causes are worded from: the API's statements about native and the call's numbers.

    Attributes:
        world_size: the ranks of the hook's process group.
        default_world_size: the default group's (``dist.get_world_size()`` with no group).
        rank: this rank in the hook's process group.
        sharded: the call is a reduce-scatter (each rank keeps one shard).
        reduce_in: the dtype native reduces in; ``own``: the gradient's (the result's) dtype.
        claim: the reduce dtype the hook claims, or ``None``.
        describe: native's arithmetic in a few words (``"DDP with no hook multiplies by 1/3 before the SUM"``).
        average: native's averaging as an instruction to a hook author.
        group_arg: how a hook names its process group in code (``"group=state.process_group"``).
        describe_as: native's arithmetic in a few words, dividing as for another world size.
        given: the dtype of the hook's input; ``None``: :attr:`own`.
        why_not_rounded: ``(narrow, given)`` -> why the input need not hold ``narrow`` values, for the fix of a
            hook that rounds it to ``narrow`` (the API's own words, see
            :meth:`conformance.ranks.arithmetic.Arithmetic.why_not_rounded`).
    """

    world_size: int
    default_world_size: int
    rank: int
    sharded: bool
    reduce_in: torch.dtype
    own: torch.dtype
    claim: Optional[torch.dtype]
    describe: str
    average: str
    group_arg: str
    describe_as: Callable[[int], str]
    given: Optional[torch.dtype] = None
    why_not_rounded: Callable[[torch.dtype, torch.dtype], str] = lambda narrow, given: ""

    def of(self, native: Reduction, change: Reduction) -> Tuple[str, str]:
        """``(cause, fix)`` of ``change``, native's reduction with some fields changed: ``("native", "")`` for
        native itself."""
        if change == native:
            return "native", ""
        if change.collective == ALL_REDUCE_THEN_CHUNK != native.collective:
            return self._all_reduce_then_chunk(change)
        if change.read != native.read:
            k = (self.rank - change.read) % self.world_size
            return f"the reduced shard of rank {k}, not this rank's ({self.rank})", f"{self._keep()}, not rank {k}'s chunk"
        if change.group == DEFAULT_GROUP:
            return self._default_group(native, change)
        if change.divides_as is not None:
            n, ws = change.divides_as, self.world_size
            return (f"divided as for {n} ranks ({self.describe_as(n).split(' ', 1)[1]}), where the group has {ws}",
                    f"divide as for the group's {ws} ranks, not {n}: {self.average}")
        if change.dtype != native.dtype:
            return self._dtype(change.dtype or self.reduce_in)
        if change.rounded_to != native.rounded_to and change.rounded_to is not None:
            return self._rounded(native, change.rounded_to)
        return self._arithmetic(native, change)

    def _keep(self) -> str:
        return (f"keep this rank's own chunk, chunk {self.rank} of {self.world_size} (index dist.get_rank(group)), as "
                "a reduce-scatter (dist.reduce_scatter_tensor) does")

    def _all_reduce_then_chunk(self, change: Reduction) -> Tuple[str, str]:
        k = (self.rank - change.read) % self.world_size
        if k == self.rank:
            return ("an all-reduce of the whole buffer, then rank {k}'s chunk (native's values, summed in the "
                    "all-reduce's order, not the reduce-scatter's)".format(k=k),
                    "reduce-scatter (dist.reduce_scatter_tensor), as native does, instead of an all-reduce and a "
                    "chunk: it sums in the reduce-scatter's order")
        return (f"an all-reduce of the whole buffer, then rank {k}'s chunk: the reduced shard of rank {k}, not this "
                f"rank's ({self.rank})", f"{self._keep()}, not rank {k}'s chunk")

    def _default_group(self, native: Reduction, change: Reduction) -> Tuple[str, str]:
        d, ws = self.default_world_size, self.world_size
        ask = (f"pass {self.group_arg} to dist.get_world_size (with no group it returns {d}, the default group's size; "
               f"the hook's group has {ws})")
        if change.divides_as is not None:  # native's arithmetic, dividing as for the default group
            return (f"divided as for {d} ranks, the default group's size (dist.get_world_size() with no group), where "
                    f"the hook's process group has {ws}: ask the process group, dist.get_world_size(group)", ask)
        did = self._arithmetic(native, change)[0].split(", where ", 1)[0]
        return f"{did} (the default group's size, not the process group's {ws})", ask

    def _dtype(self, other: torch.dtype) -> Tuple[str, str]:
        """"reduced in ``other``" where native reduces in :attr:`reduce_in`: reduce in that dtype, or claim
        ``other`` where the rounding is meant."""
        claimed = "no reduce dtype (the gradient's own)" if self.claim is None else dtype_name(self.claim)
        own, name = dtype_name(self.reduce_in), dtype_name(other)
        if self.claim is None:
            fix = (f"claim reduce_dtype=torch.{name} in the HookSpec if reducing in {name} is meant (native then "
                   f"reduces in it too); else reduce in the gradient's own dtype ({own}), with no cast before the "
                   "collective")
        else:
            fix = (f"reduce in {own}, the claimed reduce_dtype: cast to {own}, not {name}, before the collective; or "
                   f"claim reduce_dtype=torch.{name} if that is meant")
        return f"reduced in {name}, where the hook claims {claimed}", fix

    def _rounded(self, native: Reduction, narrow: torch.dtype) -> Tuple[str, str]:
        """The input rounded to ``narrow`` before native's reduction: reduce it in its own dtype, with the API's
        reason why its values need not be ``narrow`` values."""
        given = self.given or self.own
        low, own = dtype_name(narrow), dtype_name(given)
        why = self.why_not_rounded(narrow, given)
        why = f": {why}" if why else ""
        if native.collective == NO_COLLECTIVE:  # the API hands the hook a finished result, to leave as it is
            return (f"the {own} tensor rounded to {low} (cast to {low} and back), where {self.describe}",
                    f"leave the tensor in its own dtype ({own}), with no cast to {low}{why}")
        return (f"the {own} input rounded to {low} (cast to {low} and back) before an otherwise native reduction, "
                f"where {self.describe}",
                f"reduce the input in its own dtype ({own}), with no cast to {low} before the collective{why}")

    def _arithmetic(self, native: Reduction, change: Reduction) -> Tuple[str, str]:
        """The scaling and the summation order the hook did (``pre``, ``op``, ``post``, ``order``), as one
        sentence, and the fix: native's averaging instead."""
        pre, post, average = change.pre, change.post, self.average
        extra = post[len(native.post):]
        if dataclasses.replace(change, post=post[:len(native.post)]) == native and len(extra) == 1:
            return (f"averaged twice: native's average {extra[0].words()} again",
                    f"divide once: {average}; do not divide the result again")
        where = f", where {self.describe}"
        if change.order != THE_COLLECTIVES:
            shown = {RANK: f"in rank order ({' + '.join(f'rank {i}' for i in range(self.world_size))})",
                     RING: "in ring order (chunk c summed from rank c round the ring)",
                     PAIRWISE: f"in pairwise order ({pairwise_text(self.world_size)})"}[change.order]
            by = "dist.reduce_scatter_tensor" if self.sharded else "dist.all_reduce"
            fix = (f"reduce with {by} itself, not a sum of every rank's values in {_ORDER_NAMES[change.order]} "
                   f"computed by the hook, and {average}")
            summed = ("summed " if change.order == RANK else "SUM ") + shown
            if not pre and not post:
                return f"{summed}, without averaging", fix
            if not pre:
                return f"{summed}, then {_words(post)}{where}", fix
            each = "each rank's values " if change.order == RANK else ""
            then = f", then {_words(post)}" if post else ""
            return f"{each}{_words(pre)}, then summed {shown}{then}{where}", fix
        low, own = dtype_name(change.dtype or self.reduce_in), dtype_name(self.own)
        if not pre and not post:
            return (f"SUM without averaging: {self.world_size} times native's average (the group's size)",
                    f"average: {average}")
        if not pre and all(s.own_dtype for s in post):
            return (f"SUM in {low}, cast back to {own}, then {_words(post)} in {own}{where}",
                    f"{average}, instead of casting the {low} SUM back to {own} and dividing there")
        if not post and all(s.own_dtype for s in pre):
            return (f"{_words(pre)} in {own}, then cast to {low} and SUMmed{where}",
                    f"{average}, instead of dividing in {own} before the cast to {low}")
        if not post:
            return f"{_words(pre)} before the SUM{where}", f"{average}, instead of {pre[0].doing()} before the SUM"
        if not pre:
            return f"SUM, then {_words(post)}{where}", f"{average}, instead of {post[0].doing('the SUM')}"
        return (f"{_words(pre)} before the SUM, then {_words(post)}{where}",
                f"{average}, instead of {pre[0].doing()} before the SUM and {post[0].doing('the SUM')}")
