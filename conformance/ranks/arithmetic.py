"""How the native path reduces one buffer: the arithmetic a hook API's diagnosis recomputes a hook call against.

Each hook API has its own :class:`Arithmetic` in its folder (FSDP1's pre- and
post-divide, DDP's ``1/N`` before the SUM, the op FSDP2 hands a comm, native
HSDP's result an all-reduce hook receives), and its models hand it to the
diagnosis (:attr:`conformance.ranks.checks.models.ApiModels.arithmetic`). The
diagnosis (:mod:`conformance.ranks.diagnosis`) knows no API: it asks the
arithmetic for native's result and for the named causes, so an API without one
cannot be diagnosed at all rather than as another API.

:meth:`Arithmetic.candidates` is written once here over one primitive, the
API's :meth:`Arithmetic.reduce`, and a few facts the API states: whether
dividing by the world size before the SUM is its own order, and which wrong
world sizes a hook might divide as for. Candidates run collectives, so every
rank must ask for them at the same point, and the list depends only on the
API, the claim, the world size and the call's shape.

Each candidate carries the fix its cause implies (:class:`Candidate`), worded
for the API by the same arithmetic: how native averages
(:meth:`Arithmetic.how_to_average`), where the API reads the result
(:meth:`Arithmetic.where_result_goes`) and how the hook names its process group
(:attr:`Arithmetic.group_arg`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from conformance.ulps import bits_equal, dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.diagnosis import HookCall  # typing only: diagnosis imports this module

__all__ = ["Arithmetic", "Candidate", "reduced"]


class Candidate(NamedTuple):
    """One named cause of a hook call's result: ``cause`` (its words, as the diagnosis prints them), ``value``
    (the result it would give: 1-D, ``call.output``'s dtype and shape), and ``fix`` (the change to the hook it
    implies, one instruction worded for the API; ``""`` where none follows, as for native itself)."""

    cause: str
    value: torch.Tensor
    fix: str = ""


def reduced(x: torch.Tensor, call: "HookCall", group: Any, world_size: int, shift: int = 0,
            op: Any = None) -> torch.Tensor:
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


def rank_values(x: torch.Tensor, group: Any, world_size: int) -> List[torch.Tensor]:
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


def _pairwise_text(n: int) -> str:
    """``"(rank 0 + rank 1) + (rank 2 + rank 3)"``: the bracketing of :func:`in_pairwise_order` over ``n`` ranks."""
    text = _pairwise([f"rank {i}" for i in range(n)], lambda a, b: f"({a} + {b})")
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def _chunks_differ(values: Sequence[torch.Tensor], n: int, a: int, b: int) -> bool:
    """Whether chunk ``a`` and chunk ``b`` (of ``n``) differ in the bits of any rank's values: where they do not
    (symmetric or constant inputs), a shard of the wrong rank cannot be told from the right one."""
    for v in values:
        ca, cb = v.chunk(n)[a], v.chunk(n)[b]
        if ca.shape != cb.shape or not bool(bits_equal(ca, cb).all()):
            return True
    return False


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


@dataclasses.dataclass(frozen=True)
class Arithmetic(abc.ABC):
    """How one hook API's native path reduces one buffer, and the causes a hook's result is tested against.

    Attributes:
        world_size: the ranks the native reduction averages over.
        reduce_dtype: the dtype the hook claims native reduces in, or ``None`` (the gradient's own).
    """

    world_size: int
    reduce_dtype: Optional[torch.dtype]

    #: Whether dividing by the world size before the SUM is native's own order here, so that cause would
    #: name native (FSDP1 where the pre-divide factor is the world size).
    divides_before_sum = False

    #: Whether the hook picks its own divisor (FSDP1, DDP): then a divisor read off the default group
    #: (``dist.get_world_size()`` with no group) where the hook's process group is smaller is a cause.
    #: FSDP2 tells a comm the op and divides itself.
    hook_picks_divisor = True

    @abc.abstractmethod
    def reduce(self, t: torch.Tensor, cast: bool, call: "HookCall", group: Any, group_size: int,
               shift: int) -> torch.Tensor:
        """Native's reduction of ``t`` (the hook's input, already in the dtype reduced in; ``cast``: not the
        input's own dtype) over ``group`` of ``group_size`` ranks, with :func:`reduced` (``shift`` as there)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Native's arithmetic in a few words, for causes (``"FSDP pre-divides by 2 and post-divides by 1.5"``)."""

    #: How a hook names the process group the API gives it, in code, for fixes (``"group=state.process_group"``).
    group_arg = "group=<the hook's process group>"

    @abc.abstractmethod
    def how_to_average(self) -> str:
        """Native's averaging as an instruction to a hook author, for fixes: ``"multiply the bucket by 1/3 before
        the all-reduce (DDP scales each gradient by 1/world_size as it fills the bucket)"``."""

    @abc.abstractmethod
    def where_result_goes(self, call: "HookCall") -> str:
        """Where the API reads the hook's result, as an instruction, for fixes: ``"complete the future with the
        reduced bucket (DDP copies the future's value over the gradients)"``."""

    def wrong_world_sizes(self) -> Sequence[int]:
        """World sizes a hook might divide as for, where the group has :attr:`world_size`: the next power of two
        and the neighbours."""
        ws = self.world_size
        return sorted({1 << (ws - 1).bit_length(), ws - 1, ws + 1} - {ws, 0, 1})

    def dividing_as(self, world_size: int) -> "Arithmetic":
        """The same arithmetic dividing as for ``world_size`` ranks (the collectives stay on the real group)."""
        return dataclasses.replace(self, world_size=world_size)

    def for_call(self, call: "HookCall") -> "Arithmetic":
        """The arithmetic of one call: over the group the API passed the hook, where it passed one."""
        return self if call.group is None else dataclasses.replace(self, world_size=call.group.size())

    def native(self, x: torch.Tensor, call: "HookCall", group: Any, dtype: Optional[torch.dtype], shift: int = 0,
               group_size: Optional[int] = None) -> torch.Tensor:
        """Native's arithmetic on ``x`` in ``dtype`` (``None``: the input's own), as ``call.output``'s dtype.

        ``group_size``: the ranks the collective spans, when this arithmetic divides as for another world size.
        """
        t = x.to(dtype) if dtype is not None else x.clone()
        s = self.reduce(t, t.dtype != x.dtype, call, group, group_size or self.world_size, shift)
        return s.to(call.output.dtype)

    def native_result(self, call: "HookCall", group: Any) -> torch.Tensor:
        """What native produces from ``call.input`` (the first of :meth:`candidates`), one collective."""
        return self.native(call.input, call, group, self.reduce_dtype)

    def unreduced(self, call: "HookCall", rank: int) -> torch.Tensor:
        """The hook's input as its result would hold it unreduced (this rank's chunk when sharded)."""
        x = call.input.chunk(self.world_size)[rank] if call.sharded else call.input
        return x.to(call.output.dtype)

    def candidates(self, call: "HookCall", group: Any, rank: int) -> List[Candidate]:
        """Every named cause for ``call`` (:class:`Candidate`: the cause, its result, its fix), native first; the
        same collectives, in the same order, on every rank."""
        ws, x, claim = self.world_size, call.input, self.reduce_dtype
        reduce_in = claim or x.dtype
        dtype = call.output.dtype
        average = self.how_to_average()
        out: List[Candidate] = [Candidate("native", self.native(x, call, group, claim))]
        summed = reduced(x.to(reduce_in), call, group, ws)
        # Named before "averaged twice", which it equals bit for bit where both sizes are powers of two.
        default_ws = dist.get_world_size() if self.hook_picks_divisor else ws
        if default_ws != ws:
            source = (f"{default_ws} ranks, the default group's size (dist.get_world_size() with no group), where "
                      f"the hook's process group has {ws}: ask the process group, dist.get_world_size(group)")
            ask = (f"pass {self.group_arg} to dist.get_world_size (with no group it returns {default_ws}, the default "
                   f"group's size; the hook's group has {ws})")
            out.append(Candidate(f"divided as for {source}", self.dividing_as(default_ws).native(
                x, call, group, claim, group_size=ws), ask))
            out.append(Candidate(f"SUM, then divided by {default_ws} (the default group's size, not the process "
                                 f"group's {ws})", summed.div(default_ws).to(dtype), ask))
        out.append(Candidate(f"SUM without averaging: {ws} times native's average (the group's size)",
                             summed.to(dtype), f"average: {average}"))
        out.append(Candidate(f"averaged twice: native's average divided by {ws} again",
                             out[0].value.to(reduce_in).div(ws).to(dtype),
                             f"divide once: {average}; do not divide the result again"))
        out.append(Candidate(f"SUM, then divided by {ws}, where {self.describe()}", summed.div(ws).to(dtype),
                             f"{average}, instead of dividing the SUM by {ws}"))
        if not self.divides_before_sum:
            out.append(Candidate(f"divided by {ws} before the SUM, where {self.describe()}",
                                 reduced(x.to(reduce_in).div(ws), call, group, ws).to(dtype),
                                 f"{average}, instead of dividing by {ws} before the SUM"))
        # A hook that gathers every rank's values and reduces them itself sums in rank order, not in the
        # collective's order (which need not be rank order at 3 or more ranks).
        gathered = rank_values(x.to(reduce_in), group, ws)
        mine = (lambda t: t.chunk(ws)[rank]) if call.sharded else (lambda t: t)
        order = " + ".join(f"rank {i}" for i in range(ws))
        by = "dist.reduce_scatter_tensor" if call.sharded else "dist.all_reduce"
        collective = (f"reduce with {by} itself, not a sum of every rank's values in {{}} computed by the hook, "
                      f"and {average}")
        out.append(Candidate(f"summed in rank order ({order}), then divided by {ws}, where {self.describe()}",
                             mine(in_rank_order(gathered).div(ws)).to(dtype), collective.format("rank order")))
        out.append(Candidate(f"each rank's values multiplied by 1/{ws}, then summed in rank order ({order}), where "
                             f"{self.describe()}", mine(in_rank_order([g.mul(1.0 / ws) for g in gathered])).to(dtype),
                             collective.format("rank order")))
        if ws >= 3 and not call.sharded:
            # A ring all-reduce (a reduce-scatter pass, then an all-gather) sums chunk c from rank c on; at 2
            # ranks every order is the same.
            ring = "in ring order (chunk c summed from rank c round the ring)"
            fix = collective.format("ring order")
            out.append(Candidate(f"SUM {ring}, without averaging", in_ring_order(gathered).to(dtype), fix))
            out.append(Candidate(f"SUM {ring}, then divided by {ws}, where {self.describe()}",
                                 in_ring_order(gathered).div(ws).to(dtype), fix))
            out.append(Candidate(f"multiplied by 1/{ws}, then summed {ring}, where {self.describe()}",
                                 in_ring_order([g.mul(1.0 / ws) for g in gathered]).to(dtype), fix))
        if ws >= 4:
            # A tree all-reduce (recursive doubling: pairs, then pairs of pairs), written with send/recv or
            # summed over gathered values; the same as rank order below 4 ranks.
            pairwise = f"in pairwise order ({_pairwise_text(ws)})"
            fix = collective.format("pairwise (tree) order")
            out.append(Candidate(f"SUM {pairwise}, without averaging", mine(in_pairwise_order(gathered)).to(dtype),
                                 fix))
            out.append(Candidate(f"SUM {pairwise}, then divided by {ws}, where {self.describe()}",
                                 mine(in_pairwise_order(gathered).div(ws)).to(dtype), fix))
            out.append(Candidate(f"multiplied by 1/{ws}, then summed {pairwise}, where {self.describe()}",
                                 mine(in_pairwise_order([g.mul(1.0 / ws) for g in gathered])).to(dtype), fix))
        if reduce_in != dtype:
            # Where the hook divides matters as much as when: in the reduce dtype or in the gradient's own.
            low, own = dtype_name(reduce_in), dtype_name(dtype)
            out.append(Candidate(f"SUM in {low}, cast back to {own}, then divided by {ws} in {own}, where "
                                 f"{self.describe()}", summed.to(dtype).div(ws),
                                 f"{average}, instead of casting the {low} SUM back to {own} and dividing there"))
            out.append(Candidate(f"divided by {ws} in {own}, then cast to {low} and SUMmed, where {self.describe()}",
                                 reduced(x.div(ws).to(reduce_in), call, group, ws).to(dtype),
                                 f"{average}, instead of dividing in {own} before the cast to {low}"))
        for other in (torch.float32, torch.bfloat16, torch.float16):
            if other != reduce_in:
                claimed = "no reduce dtype (the gradient's own)" if claim is None else dtype_name(claim)
                out.append(Candidate(f"reduced in {dtype_name(other)}, where the hook claims {claimed}",
                                     self.native(x, call, group, other), self._dtype_fix(other, reduce_in)))
        for wrong in [w for w in self.wrong_world_sizes() if w != default_ws]:
            out.append(Candidate(f"divided as for {wrong} ranks "
                                 f"({self.dividing_as(wrong).describe().split(' ', 1)[1]}), where the group has {ws}",
                                 self.dividing_as(wrong).native(x, call, group, claim, group_size=ws),
                                 f"divide as for the group's {ws} ranks, not {wrong}: {average}"))
        if call.sharded:
            keep = (f"keep this rank's own chunk, chunk {rank} of {ws} (index dist.get_rank(group)), as a "
                    "reduce-scatter (dist.reduce_scatter_tensor) does")
            for shift in range(1, ws):
                other = self.native(x, call, group, claim, shift=shift)  # a collective: computed on every rank
                if _chunks_differ(gathered, ws, (rank - shift) % ws, rank):  # else no data tells them apart
                    out.append(Candidate(f"the reduced shard of rank {(rank - shift) % ws}, not this rank's ({rank})",
                                         other, f"{keep}, not rank {(rank - shift) % ws}'s chunk"))
            # A hand-rolled reduce-scatter: all-reduce the whole buffer, keep one chunk (summed in the
            # all-reduce's order, which need not be the reduce-scatter's at 3 or more ranks).
            full = self.native(x, dataclasses.replace(call, sharded=False), group, claim).chunk(ws)
            for k in [k for k in range(ws) if k == rank or _chunks_differ(gathered, ws, k, rank)]:
                out.append(Candidate(f"an all-reduce of the whole buffer, then rank {k}'s chunk" + (
                    " (native's values, summed in the all-reduce's order, not the reduce-scatter's)" if k == rank else
                    f": the reduced shard of rank {k}, not this rank's ({rank})"), full[k],
                    "reduce-scatter (dist.reduce_scatter_tensor), as native does, instead of an all-reduce and a "
                    "chunk: it sums in the reduce-scatter's order" if k == rank else f"{keep}, not rank {k}'s chunk"))
        return out

    def _dtype_fix(self, other: torch.dtype, reduce_in: torch.dtype) -> str:
        """The fix of "reduced in ``other``" where native reduces in ``reduce_in`` (the claim, or the gradient's
        own dtype): reduce in that dtype, or claim ``other`` where the rounding is meant."""
        own = dtype_name(reduce_in)
        if self.reduce_dtype is None:
            return (f"claim reduce_dtype=torch.{dtype_name(other)} in the HookSpec if reducing in "
                    f"{dtype_name(other)} is meant (native then reduces in it too); else reduce in the gradient's "
                    f"own dtype ({own}), with no cast before the collective")
        return (f"reduce in {own}, the claimed reduce_dtype: cast to {own}, not {dtype_name(other)}, before the "
                f"collective; or claim reduce_dtype=torch.{dtype_name(other)} if that is meant")
