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
  rank 2), then multiplied by 1/3", "averaged twice", native's pre-divide without
  its post-divide;
* ``order`` :data:`~conformance.ranks.reduction.NODES` with ``between``: a sum
  within each node, then across nodes, by how far its divisors (before, between
  and after the levels) fall from native's: a two-level mean, averaged twice
  across the levels, a division missing at one level, no division at all.

Each comes with its fix, one instruction worded for the API by what its
arithmetic states (:class:`Words`: how native averages, how the hook names its
process group), as a :class:`~conformance.protocol.Cause` whose code and
parameters come from the change itself, never from its words. This module knows
no API and recomputes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from conformance.protocol import Cause
from conformance.ranks.reduction import (ALL_REDUCE_THEN_CHUNK, DEFAULT_GROUP, NO_COLLECTIVE, PAIRWISE, RANK, RING,
                                         NODES, THE_COLLECTIVES, Reduction, Scale, pairwise_text)
from conformance.ulps import dtype_name

__all__ = ["Words"]

#: How a fix names each summation order a hook may compute itself.
_ORDER_NAMES = {RANK: "rank order", RING: "ring order", PAIRWISE: "pairwise (tree) order"}


def _words(steps: Sequence[Scale]) -> str:
    return " and ".join(s.words() for s in steps)


def _how(steps: Sequence[Scale]) -> str:
    """How ``steps`` scale, without their numbers (a :class:`~conformance.protocol.Cause` parameter):
    ``"divide"``, ``"reciprocal"``, ``"divide in own dtype"``, joined by ``" and "``; ``""`` for none."""
    return " and ".join(("reciprocal" if s.reciprocal else "divide") + (" in own dtype" if s.own_dtype else "")
                        for s in steps)


def _n(x: float) -> "int | float":
    """A divisor as a parameter: an ``int`` where it is whole."""
    return int(x) if float(x).is_integer() else float(x)


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
        layout: ``(LOCAL_WORLD_SIZE, nodes)`` of a job across nodes (torchrun's variables,
            :func:`conformance.ranks.arithmetic.node_layout`), or ``None``: a divisor equal to one of them is
            named as read off the layout.
        result_goes: where the API reads the hook's result, as an instruction (the arithmetic's
            :meth:`~conformance.ranks.arithmetic.Arithmetic.where_result_goes`), for the fix of a post-divide that
            never reached it; ``""``: not said.
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
    layout: Optional[Tuple[int, int]] = None
    result_goes: str = ""

    def of(self, native: Reduction, change: Reduction) -> Cause:
        """The cause ``change`` is, native's reduction with some fields changed, with its words and fix: code
        ``"native"`` (no words, no fix) for native itself."""
        if change == native:
            return Cause("native", words="native")
        if change.collective == ALL_REDUCE_THEN_CHUNK != native.collective:
            return self._all_reduce_then_chunk(change)
        if change.read != native.read:
            k = (self.rank - change.read) % self.world_size
            return Cause("other_rank_shard", (("shard_of", k), ("rank", self.rank)),
                         f"the reduced shard of rank {k}, not this rank's ({self.rank})",
                         f"{self._keep()}, not rank {k}'s chunk")
        if change.group == DEFAULT_GROUP:
            return self._default_group(native, change)
        if change.divides_as is not None and self.layout and change.divides_as in self.layout:
            return self._layout_divisor(change.divides_as)
        if change.divides_as is not None:
            n, ws = change.divides_as, self.world_size
            return Cause("wrong_divisor", (("divides_as", n), ("group_size", ws)),
                         f"divided as for {n} ranks ({self.describe_as(n).split(' ', 1)[1]}), where the group has {ws}",
                         f"divide as for the group's {ws} ranks, not {n}: {self.average}")
        if change.dtype != native.dtype:
            return self._dtype(change.dtype or self.reduce_in)
        if change.rounded_to != native.rounded_to and change.rounded_to is not None:
            return self._rounded(native, change.rounded_to)
        if change.order == NODES != native.order:
            return self._two_level(native, change)
        if native.pre and native.post and not change.post and dataclasses.replace(change, post=native.post) == native:
            return self._post_missing(native, change)
        return self._arithmetic(native, change)

    def _layout_divisor(self, n: int) -> Cause:
        """Divided as for ``n`` ranks, a size of the job's node layout (:attr:`layout`), where the group spans the
        nodes: the divisor read off torchrun's variables instead of the process group."""
        local, nodes = self.layout or (0, 0)
        ws = self.world_size
        read = " or ".join(name for name, size in ((f"LOCAL_WORLD_SIZE={local}", local),
                                                   (f"the node count, GROUP_WORLD_SIZE={nodes}", nodes)) if size == n)
        return Cause("wrong_divisor", (("divides_as", n), ("group_size", ws), ("read_off", "node layout")),
                     f"divided as for {n} ranks ({self.describe_as(n).split(' ', 1)[1]}), read off the job's node "
                     f"layout of {nodes} nodes of {local} ({read}), where the group has {ws}",
                     f"divide as for the process group's {ws} ranks (dist.get_world_size(group)), not a size of the "
                     f"node layout (LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE): {self.average}")

    def _post_missing(self, native: Reduction, change: Reduction, levels: str = "") -> Cause:
        """Native's pre-divide without its post-divide (code ``"post_divide_missing"``): the result never divided
        after the SUM, as where a hook post-divides another tensor than the one the API reads (FSDP1's ``grad``
        after a reduce-scatter into ``output``). ``levels``: the words of a two-level order the hook summed in."""
        post, k = native.post, math.prod(s.n for s in native.post)
        where = "" if levels else f", where {self.describe}"
        words = (f"native's pre-divide without its post-divide: {_words(change.pre)} before the SUM{levels}, never "
                 f"{_words(post)} after it (the post-divide never reached the result the API reads): {k:g} times "
                 f"native's average{where}")
        if self.result_goes:
            scale = " and ".join(f"multiply that tensor by 1/{s.n:g}" if s.reciprocal else
                                 f"divide that tensor by {s.n:g}" for s in post)
            fix = (f"apply the post-divide to the tensor the API reads, after the SUM: {self.result_goes}, then "
                   f"{scale}; a post-divide of another tensor (the input, a copy) never reaches the result")
        else:
            fix = f"apply the post-divide to the result, after the SUM: {self.average}"
        return Cause("post_divide_missing", (("order", change.order), ("pre", _how(change.pre)),
                                             ("post", _how(post)), ("divisor", _n(k))), words, fix)

    def _two_level(self, native: Reduction, change: Reduction) -> Cause:
        """A sum within each node, then across nodes (order :data:`~conformance.ranks.reduction.NODES`), by how far
        its divisors (``pre``, ``between``, ``post``) fall from native's: ``"rounding_order"`` (native's average in
        two levels), ``"divided_twice"`` (averaged at both levels and again), ``"level_divide_missing"`` (one
        level left undivided), ``"sum_not_averaged"``, or native's pre-divide without its post-divide
        (:meth:`_post_missing`). Parameters: the order and how it scales at each level; the fix: one collective over
        the hook's group, averaged as native does."""
        local, ws = change.node_size or self.world_size, self.world_size
        levels = f"summed within each node, then across nodes ({ws // local} nodes of {local} ranks)"
        by = "dist.reduce_scatter_tensor" if self.sharded else "dist.all_reduce"
        flat = (f"reduce with one {by} over the hook's process group, not within each node and then across nodes (a "
                "two-level sum rounds otherwise than native's)")
        params = (("order", NODES),) + tuple((name, _how(steps)) for name, steps in (
            ("pre", change.pre), ("between", change.between), ("post", change.post)) if steps)
        if native.pre and native.post and not change.post and dataclasses.replace(
                change, order=native.order, node_size=None, post=native.post) == native:
            missing = self._post_missing(native, change, f", {levels}")
            return dataclasses.replace(missing, fix=f"{missing.fix}; and {flat}")
        steps = change.pre + change.between + change.post
        if not steps:
            return Cause("sum_not_averaged", params, f"{levels}, without averaging: {ws} times native's average (the "
                         "group's size)", f"average: {self.average}; and {flat}")
        ratio = math.prod(s.n for s in steps) / math.prod(s.n for s in native.pre + native.post)
        parts = [f"each rank's values {_words(change.pre)} first"] if change.pre else []
        parts += [f"{whose} {_words(level)}{self._size_of(level, local, mine)}" for whose, level, mine in (
            ("each node's sum", change.between, ()), ("the sum across nodes", change.post, native.post)) if level]
        how = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        if math.isclose(ratio, 1.0):
            return Cause("rounding_order", params, f"{levels}, {how}, where {self.describe}",
                         f"{flat}, and {self.average}")
        if ratio > 1:
            return Cause("divided_twice", params,
                         f"averaged twice across the levels: {levels}, {how}: 1/{ratio:g} of native's average",
                         f"divide once: {self.average}, not within each node and again across nodes; and {flat}")
        undivided = "the sum across nodes" if change.between and not change.post else "each node's sum"
        return Cause("level_divide_missing", params,
                     f"a division missing at one level: {levels}, {how}, {undivided} never divided: {1 / ratio:g} "
                     "times native's average",
                     f"divide by the group's {ws} ranks in all (LOCAL_WORLD_SIZE within the node and the node count "
                     f"across nodes, or the world size once): {self.average}; and {flat}")

    def _size_of(self, steps: Sequence[Scale], local: int, natives: Sequence[Scale]) -> str:
        """Which size of the node layout a divisor between or after the levels is, as words to append:
        ``" (LOCAL_WORLD_SIZE)"``, ``" (the world size)"``; ``""`` for native's own divisor there (``natives``), or a
        number that is none of them."""
        if tuple(steps) == tuple(natives):
            return ""
        ws = self.world_size
        names = [name for name, size in (("LOCAL_WORLD_SIZE", local), ("the node count", ws // local),
                                         ("the world size", ws)) if size == steps[0].n]
        return f" ({' or '.join(names)})" if names else ""

    def _keep(self) -> str:
        return (f"keep this rank's own chunk, chunk {self.rank} of {self.world_size} (index dist.get_rank(group)), as "
                "a reduce-scatter (dist.reduce_scatter_tensor) does")

    def _all_reduce_then_chunk(self, change: Reduction) -> Cause:
        k = (self.rank - change.read) % self.world_size
        if k == self.rank:
            return Cause("all_reduce_then_chunk", (("rank", k),),
                         "an all-reduce of the whole buffer, then rank {k}'s chunk (native's values, summed in the "
                         "all-reduce's order, not the reduce-scatter's)".format(k=k),
                         "reduce-scatter (dist.reduce_scatter_tensor), as native does, instead of an all-reduce and "
                         "a chunk: it sums in the reduce-scatter's order")
        return Cause("other_rank_shard", (("shard_of", k), ("rank", self.rank), ("by", "all-reduce then chunk")),
                     f"an all-reduce of the whole buffer, then rank {k}'s chunk: the reduced shard of rank {k}, not "
                     f"this rank's ({self.rank})", f"{self._keep()}, not rank {k}'s chunk")

    def _default_group(self, native: Reduction, change: Reduction) -> Cause:
        d, ws = self.default_world_size, self.world_size
        ask = (f"pass {self.group_arg} to dist.get_world_size (with no group it returns {d}, the default group's size; "
               f"the hook's group has {ws})")
        sizes = (("divides_as", d), ("group_size", ws))
        if change.divides_as is not None:  # native's arithmetic, dividing as for the default group
            return Cause("default_group_size", sizes,
                         f"divided as for {d} ranks, the default group's size (dist.get_world_size() with no group), "
                         f"where the hook's process group has {ws}: ask the process group, dist.get_world_size(group)",
                         ask)
        did = self._arithmetic(native, change, where=False)
        return Cause("default_group_size", sizes + (("as", did.code),) + did.params,
                     f"{did.words} (the default group's size, not the process group's {ws})", ask)

    def _dtype(self, other: torch.dtype) -> Cause:
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
        claim = None if self.claim is None else dtype_name(self.claim)
        return Cause("other_dtype", (("dtype", name), ("claim", claim)), f"reduced in {name}, where the hook claims "
                     f"{claimed}", fix)

    def _rounded(self, native: Reduction, narrow: torch.dtype) -> Cause:
        """The input rounded to ``narrow`` before native's reduction: reduce it in its own dtype, with the API's
        reason why its values need not be ``narrow`` values."""
        given = self.given or self.own
        low, own = dtype_name(narrow), dtype_name(given)
        why = self.why_not_rounded(narrow, given)
        why = f": {why}" if why else ""
        params = (("dtype", low), ("input_dtype", own))
        if native.collective == NO_COLLECTIVE:  # the API hands the hook a finished result, to leave as it is
            return Cause("rounded_input", params,
                         f"the {own} tensor rounded to {low} (cast to {low} and back), where {self.describe}",
                         f"leave the tensor in its own dtype ({own}), with no cast to {low}{why}")
        return Cause("rounded_input", params,
                     f"the {own} input rounded to {low} (cast to {low} and back) before an otherwise native "
                     f"reduction, where {self.describe}",
                     f"reduce the input in its own dtype ({own}), with no cast to {low} before the collective{why}")

    def _arithmetic(self, native: Reduction, change: Reduction, where: bool = True) -> Cause:
        """The scaling and the summation order the hook did (``pre``, ``op``, ``post``, ``order``), as one
        sentence, and the fix: native's averaging instead. Code ``"sum_not_averaged"``, ``"divided_twice"``
        or ``"rounding_order"`` (native's divisor, scaled or summed in another order), with the order, how it
        scales before and after the SUM and the divisor as parameters; without the words ``", where"`` native
        does otherwise, where ``where`` is false."""
        pre, post, average = change.pre, change.post, self.average
        extra = post[len(native.post):]
        steps = pre + post
        params = ((("order", change.order),) + ((("pre", _how(pre)),) if pre else ()) +
                  ((("post", _how(post)),) if post else ()) + ((("divisor", _n(steps[0].n)),) if steps else ()))
        if dataclasses.replace(change, post=post[:len(native.post)]) == native and len(extra) == 1:
            return Cause("divided_twice", (("how", _how(extra)), ("divisor", _n(extra[0].n))),
                         f"averaged twice: native's average {extra[0].words()} again",
                         f"divide once: {average}; do not divide the result again")
        code = "sum_not_averaged" if not steps else "rounding_order"
        cause, fix = self._arithmetic_words(native, change)
        return Cause(code, params, cause.split(", where ", 1)[0] if not where else cause, fix)

    def _arithmetic_words(self, native: Reduction, change: Reduction) -> Tuple[str, str]:
        """The words and the fix of :meth:`_arithmetic`."""
        pre, post, average = change.pre, change.post, self.average
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
