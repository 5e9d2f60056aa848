"""A reduction of one buffer as named fields, and the bits it gives: what the diagnosis's causes change and recompute.

Each hook API says how its native path reduces a buffer as a :class:`Reduction`
(:meth:`conformance.ranks.arithmetic.Arithmetic.reduction`): what each rank
scales its values by before the collective, the op, what the result is scaled by
after, the dtype reduced in, the summation order, the collective, the group whose
size the divisors are, and which rank's result is read. A candidate cause is that
reduction with one or two fields changed (``dataclasses.replace``): a SUM without
the divisions, a divide where native multiplies by a reciprocal, the sum a hook
computes itself in rank order, the shard of another rank, the input rounded to a
narrower dtype first, a sum within each node, then across nodes (on a job across
nodes, :data:`NODES`), divided between the two levels. :class:`Recompute`
gives the bits of any of them from a hook call's input, with the same
collectives on the same process group; :mod:`conformance.ranks.cause_words`
words the change and the fix it implies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from conformance.ranks.hook_call import HookCall

__all__ = ["ALL_REDUCE", "ALL_REDUCE_THEN_CHUNK", "DEFAULT_GROUP", "HOOK_GROUP", "NODES", "NO_COLLECTIVE", "ORDERS",
           "PAIRWISE", "RANK", "REDUCE_SCATTER", "RING", "THE_COLLECTIVES", "Recompute", "Reduction", "Scale",
           "in_node_order", "in_pairwise_order", "in_rank_order", "in_ring_order", "pairwise_text", "rank_values",
           "reduced", "rounded"]

#: The collective a reduction runs (:attr:`Reduction.collective`).
ALL_REDUCE, REDUCE_SCATTER = "all-reduce", "reduce-scatter"
#: A hand-rolled reduce-scatter: an all-reduce of the whole buffer, then one chunk kept.
ALL_REDUCE_THEN_CHUNK = "all-reduce, then a chunk"
#: No collective: the values the API hands the hook are reduced already (an FSDP2 all-reduce hook).
NO_COLLECTIVE = "none"

#: The summation order (:attr:`Reduction.order`): the collective's own, or a sum the hook computes itself over
#: every rank's values (exchanged by an all-gather, or an all-to-all where it keeps one shard).
THE_COLLECTIVES, RANK, RING, PAIRWISE = "the collective's", "rank", "ring", "pairwise"
#: A two-level summation order (:attr:`Reduction.order`): each node's ranks summed (in rank order), then the nodes'
#: sums (in node order), as a hook that all-reduces within the node and then across nodes computes it, nodes of
#: :attr:`Reduction.node_size` consecutive ranks (torchrun's layout). Exact for such a hook where a node holds at most
#: two ranks and there are at most two nodes (a sum of two is the same bits in either order); over more, the
#: collectives' own orders are not rank order.
NODES = "nodes"

#: Whose size a hook divides by (:attr:`Reduction.group`): the process group the API gives it, or the default
#: group's (``dist.get_world_size()`` with no group).
HOOK_GROUP, DEFAULT_GROUP = "the hook's group", "the default group"


@dataclasses.dataclass(frozen=True)
class Scale:
    """One scaling of the values: a divide by ``n``, or (``reciprocal``) a multiply by ``1/n``, as floats.

    ``own_dtype``: done in the gradient's own dtype, outside the cast to the reduce dtype (before it for a
    pre-scale, after the cast back for a post-scale); else in the reduce dtype.
    """

    n: float
    reciprocal: bool = False
    own_dtype: bool = False

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.mul(1.0 / self.n) if self.reciprocal else t.div(self.n)

    def words(self) -> str:
        """``"divided by 3"``, ``"multiplied by 1/3"``."""
        return f"multiplied by 1/{self.n:g}" if self.reciprocal else f"divided by {self.n:g}"

    def doing(self, what: str = "") -> str:
        """``"dividing the SUM by 3"``, ``"multiplying by 1/3"``: the scaling as a hook's action on ``what``."""
        what = f" {what}" if what else ""
        return f"multiplying{what} by 1/{self.n:g}" if self.reciprocal else f"dividing{what} by {self.n:g}"


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How one buffer is reduced, field by field; the bits are :class:`Recompute`'s.

    Attributes:
        pre: what each rank scales its values by before the collective, in order.
        op: the ``ReduceOp`` the collective runs; ``None``: SUM.
        post: what the collective's result is scaled by, in order.
        dtype: the dtype reduced in (the values are cast to it before ``pre`` and back after ``post``);
            ``None``: the input's own.
        order: the summation order: :data:`THE_COLLECTIVES`, or the order of a sum the hook computes itself
            over every rank's values (:data:`RANK`, :data:`RING`, :data:`PAIRWISE`), or within each node, then
            across nodes (:data:`NODES`).
        collective: :data:`ALL_REDUCE`, :data:`REDUCE_SCATTER`, :data:`ALL_REDUCE_THEN_CHUNK` or
            :data:`NO_COLLECTIVE` (where ``order`` is the collective's).
        read: whose result this rank reads: its own (0), or that of the rank ``read`` before it (a reduce-scatter's
            shard, or the chunk kept of an all-reduce).
        group: whose size the divisors are: :data:`HOOK_GROUP` or :data:`DEFAULT_GROUP`.
        divides_as: the world size the divisors are for, where a change made them another group's.
        rounded_to: the dtype each rank's input is rounded to before anything else (cast to it and back to its
            own dtype: a hook that keeps it in a narrower buffer, or assumes it holds that dtype's values);
            ``None``: the input as it is.
        node_size: the ranks of a node (``LOCAL_WORLD_SIZE``) where ``order`` is :data:`NODES`; else ``None``.
        between: what each node's sum is scaled by before the sum across nodes (order :data:`NODES`), in order:
            a hook that divides between the two levels (by ``LOCAL_WORLD_SIZE``: each node's mean).

    ``group`` and ``divides_as`` only say where ``pre`` and ``post`` came from: two reductions that differ in them
    alone give the same bits, and are two causes (a hook that divides by the default group's 4 ranks, or one
    that averages twice over 2).
    """

    pre: Tuple[Scale, ...] = ()
    op: Any = None
    post: Tuple[Scale, ...] = ()
    dtype: Optional[torch.dtype] = None
    order: str = THE_COLLECTIVES
    collective: str = ALL_REDUCE
    read: int = 0
    group: str = HOOK_GROUP
    divides_as: Optional[int] = None
    rounded_to: Optional[torch.dtype] = None
    node_size: Optional[int] = None
    between: Tuple[Scale, ...] = ()

    def plain_sum(self) -> "Reduction":
        """This reduction with no scaling and a SUM: what a hook that never averages computes."""
        return dataclasses.replace(self, pre=(), op=None, post=(), between=())


def reduced(x: torch.Tensor, call: HookCall, group: Optional[dist.ProcessGroup], world_size: int, shift: int = 0,
            op: Union[dist.ReduceOp, dist.ReduceOp.RedOpType, None] = None) -> torch.Tensor:
    """SUM (or ``op``) of ``x`` over the group: an all-reduce, or (``call.sharded``) a reduce-scatter giving
    this rank the shard of rank ``rank - shift`` (every rank rotates its chunks by ``shift`` first)."""
    op = dist.ReduceOp.SUM if op is None else op
    if not call.sharded:
        t = x.clone()
        dist.all_reduce(t, op=op, group=group)
        return t
    chunks = list(x.chunk(world_size))
    rotated = torch.cat([chunks[(j - shift) % world_size] for j in range(world_size)])
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter_tensor(out, rotated, op=op, group=group)
    return out


def rank_values(x: torch.Tensor, group: Optional[dist.ProcessGroup], world_size: int) -> List[torch.Tensor]:
    """Every rank's ``x`` (same shape and dtype on every rank), in rank order: an all-gather.

    The values travel as float64, which holds every float16, bfloat16 and float32 value exactly (gloo
    gathers no bfloat16), and come back in ``x``'s dtype.
    """
    wide = x.detach().to(torch.float64).contiguous()
    out = [torch.empty_like(wide) for _ in range(world_size)]
    dist.all_gather(out, wide, group=group)
    return [t.to(x.dtype) for t in out]


def in_rank_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((values[0] + values[1]) + values[2]) + ...`` in their own dtype: the sum a hook that gathered them
    computes in a loop."""
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


def _pairwise(items: Sequence[Any], add: Callable[[Any, Any], Any]) -> Any:
    """``items`` folded by ``add`` in pairs, level by level: ``add(add(i0, i1), add(i2, i3))``...; an odd one out at a
    level passes up unchanged (a tree, recursive-doubling, all-reduce's order)."""
    level = list(items)
    while len(level) > 1:
        pairs = [add(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def pairwise_text(n: int) -> str:
    """``"(rank 0 + rank 1) + (rank 2 + rank 3)"``: the bracketing of :func:`in_pairwise_order` over ``n`` ranks."""
    text = _pairwise([f"rank {i}" for i in range(n)], lambda a, b: f"({a} + {b})")
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def in_ring_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum a ring all-reduce over ``len(values)`` ranks computes: the first ``numel - numel % N`` elements
    in ``N`` equal chunks, chunk ``c`` summed from rank ``c`` round the ring (``(v[c] + v[c+1]) + ...``);
    the remaining elements in rank order (:func:`in_rank_order`)."""
    n = len(values)
    total = in_rank_order(values)
    body = values[0].numel() - values[0].numel() % n
    if body:
        flat = total.view(-1)[:body].view(n, -1)
        parts = [v.reshape(-1)[:body].view(n, -1) for v in values]
        for c in range(n):
            acc = parts[c][c].clone()
            for k in range(1, n):
                acc += parts[(c + k) % n][c]
            flat[c] = acc
    return total


def in_pairwise_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum a tree (recursive-doubling) all-reduce computes: neighbours summed in pairs, level by level,
    ``((v[0] + v[1]) + (v[2] + v[3])) + ...``; an odd one out at a level passes up unchanged. At 2 and 3 ranks
    it is :func:`in_rank_order`; it differs from 4 on."""
    return _pairwise([v.clone() for v in values], lambda a, b: a + b)


def in_node_order(values: Sequence[torch.Tensor], node_size: int,
                  between: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """The sum of :data:`NODES` order: the values of each node (``node_size`` consecutive ranks) summed in rank order,
    each node's sum passed through ``between`` (a divide between the levels), then the nodes' sums in node order:
    ``between(v[0] + v[1]) + between(v[2] + v[3])`` at 2 nodes of 2."""
    return in_rank_order([between(in_rank_order(values[i:i + node_size])) for i in range(0, len(values), node_size)])


#: A sum over every rank's values in each order a hook may compute it in.
ORDERS: Dict[str, Callable[[Sequence[torch.Tensor]], torch.Tensor]] = {
    RANK: in_rank_order, RING: in_ring_order, PAIRWISE: in_pairwise_order}


def rounded(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``t`` cast to ``dtype`` and back to its own (:attr:`Reduction.rounded_to`); ``t`` itself for ``None``."""
    return t if dtype is None else t.to(dtype).to(t.dtype)


def _scaled(t: torch.Tensor, steps: Sequence[Scale], own_dtype: bool) -> torch.Tensor:
    for step in steps:
        if step.own_dtype == own_dtype:
            t = step.apply(t)
    return t


class Recompute:
    """The bits a :class:`Reduction` gives from ``call.input`` on this rank (``rank`` of ``world_size`` in
    ``group``), as ``call.output``'s dtype and shape.

    Collective: every rank of the group must ask for the same reductions in the same order. A reduction's
    collective runs once per call whatever its scaling after it (a SUM serves every divide of the SUM), and
    every rank's input is gathered once, the first time a hook-ordered sum is asked for.
    """

    def __init__(self, call: HookCall, group: Optional[dist.ProcessGroup], world_size: int, rank: int) -> None:
        self.call, self.group, self.world_size, self.rank = call, group, world_size, rank
        self._gathered: Optional[List[torch.Tensor]] = None
        self._summed: List[Tuple[Reduction, torch.Tensor]] = []

    def gathered(self, dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
        """Every rank's input, in rank order, in ``dtype`` (``None``: its own): one all-gather, the first time."""
        if self._gathered is None:
            self._gathered = rank_values(self.call.input, self.group, self.world_size)
        return [v.to(dtype) for v in self._gathered] if dtype is not None else self._gathered

    def __call__(self, r: Reduction) -> torch.Tensor:
        low = r.dtype or self.call.input.dtype
        s = self._summed_by(r, low)
        s = _scaled(s, r.post, own_dtype=False).to(self.call.output.dtype)
        return _scaled(s, r.post, own_dtype=True)

    def _summed_by(self, r: Reduction, low: torch.dtype) -> torch.Tensor:
        """``r`` up to its collective (scaled before it, cast, reduced), cached by what that depends on."""
        key = dataclasses.replace(r, post=(), read=0 if r.collective == ALL_REDUCE_THEN_CHUNK else r.read,
                                  group=HOOK_GROUP, divides_as=None)
        found = next((s for k, s in self._summed if k == key and k.op is key.op), None)
        if found is None:
            found = self._sum(key, low)
            self._summed.append((key, found))
        if r.collective == ALL_REDUCE_THEN_CHUNK:
            return found.chunk(self.world_size)[(self.rank - r.read) % self.world_size].clone()
        return found.clone()  # each candidate's value its own tensor

    def _sum(self, r: Reduction, low: torch.dtype) -> torch.Tensor:
        ws, call = self.world_size, self.call
        if r.order != THE_COLLECTIVES:  # the hook's own sum over every rank's values
            values = [_scaled(_scaled(rounded(v, r.rounded_to), r.pre, True).to(low), r.pre, False)
                      for v in self.gathered()]
            total = in_node_order(values, r.node_size or ws, lambda t: _scaled(t, r.between, False)) \
                if r.order == NODES else ORDERS[r.order](values)
            return total.chunk(ws)[(self.rank - r.read) % ws] if call.sharded else total
        t = _scaled(_scaled(rounded(call.input, r.rounded_to), r.pre, True).to(low), r.pre, False)
        if r.collective == NO_COLLECTIVE:
            return t.clone()
        if r.collective == ALL_REDUCE_THEN_CHUNK:
            return reduced(t, dataclasses.replace(call, sharded=False), self.group, ws, op=r.op)
        return reduced(t, call, self.group, ws, shift=r.read, op=r.op)
