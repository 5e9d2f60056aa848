"""How the native path reduces one buffer: the arithmetic a hook API's diagnosis recomputes a hook call against.

Each hook API has its own :class:`Arithmetic` in its folder (FSDP1's pre- and
post-divide, DDP's ``1/N`` before the SUM, the op FSDP2 hands a comm, native
HSDP's result an all-reduce hook receives), and its models hand it to the
diagnosis (:attr:`conformance.ranks.checks.models.ApiModels.arithmetic`). The
diagnosis (:mod:`conformance.ranks.diagnosis`) knows no API: it asks the
arithmetic for native's result and for the named causes, so an API without one
cannot be diagnosed at all rather than as another API.

An API states its native reduction as named fields
(:meth:`Arithmetic.reduction`, a :class:`~conformance.ranks.reduction.Reduction`:
pre-scale, op, post-scale, reduce dtype, summation order, collective, group,
which rank's result is read) and a few facts: whether dividing by the world
size before the SUM is its own order, which wrong world sizes a hook might
divide as for. :meth:`Arithmetic.candidates` is written once here: each
candidate cause is that reduction with one or two fields changed; its bits come
from :class:`~conformance.ranks.reduction.Recompute`, its words and its fix from
:class:`~conformance.ranks.cause_words.Words`. Candidates run collectives, so
every rank must ask for them at the same point, and the list depends only on
the API, the claim, the world size, the op and the call's shape.

The fixes are worded for the API by the same arithmetic: how native averages
(:meth:`Arithmetic.how_to_average`), where the API reads the result
(:meth:`Arithmetic.where_result_goes`) and how the hook names its process group
(:attr:`Arithmetic.group_arg`).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.protocol import Cause
from conformance.ranks.cause_words import Words
from conformance.ranks import topology
from conformance.ranks.hook_call import HookCall
from conformance.ranks.reduction import (ALL_REDUCE_THEN_CHUNK, DEFAULT_GROUP, NO_COLLECTIVE, NODES, PAIRWISE, RANK,
                                         RING, Recompute, Reduction, Scale, rounded)
from conformance.shared.compare import same_bits
from conformance.ulps import dtype_name

__all__ = ["Arithmetic", "Candidate"]


class Candidate(NamedTuple):
    """One named cause of a hook call's result: ``cause`` (a :class:`~conformance.protocol.Cause`: its code and
    parameters, its words as the diagnosis prints them, and the fix it implies, ``""`` for native itself) and
    ``value`` (the result it would give: 1-D, ``call.output``'s dtype and shape)."""

    cause: Cause
    value: torch.Tensor

    @property
    def fix(self) -> str:
        return self.cause.fix


def _chunks_differ(values: Sequence[torch.Tensor], n: int, a: int, b: int) -> bool:
    """Whether chunk ``a`` and chunk ``b`` (of ``n``) differ in the bits of any rank's values: where they do not
    (symmetric or constant inputs), a shard of the wrong rank cannot be told from the right one."""
    for v in values:
        ca, cb = v.chunk(n)[a], v.chunk(n)[b]
        if not same_bits(ca, cb):
            return True
    return False


def narrower_than(given: torch.dtype, reduce_in: torch.dtype) -> List[torch.dtype]:
    """The floating dtypes a hook might round its input to before reducing it (:attr:`Reduction.rounded_to`):
    those of fewer bytes than both the input's dtype (``given``) and the dtype native reduces in; none for an
    input that is not floating point. A float32 input reduced in float32: ``[bfloat16, float16]``."""
    if not given.is_floating_point:
        return []
    return [d for d in (torch.float32, torch.bfloat16, torch.float16)
            if d.itemsize < given.itemsize and d.itemsize < reduce_in.itemsize]


def node_layout() -> Optional[Tuple[int, int]]:
    """``(LOCAL_WORLD_SIZE, nodes)`` of the job this rank runs in, as torchrun's variables say (a case that
    simulates several nodes sets them while it runs, :func:`conformance.ranks.topology.simulated`), where the job
    spans more than one node; else ``None``. The same on every rank: a homogeneous layout."""
    nodes = topology.nodes_of_env(os.environ)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return None
    return (local, nodes) if nodes and nodes > 1 and local > 0 else None


def _rounding_changes(values: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether rounding to ``dtype`` (cast to it and back) changes any bit of any rank's ``values``."""
    return any(not same_bits(v, rounded(v, dtype)) for v in values)


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

    #: Whether a hook's divisor may be read off the default group (``dist.get_world_size()`` with no group)
    #: where its process group is smaller: then dividing as for the default group's size is a cause.
    hook_picks_divisor = True

    @abc.abstractmethod
    def reduction(self, call: HookCall) -> Reduction:
        """Native's reduction of ``call.input`` as named fields, in :attr:`reduce_dtype` (``None``: the input's
        own), dividing as for :attr:`world_size` ranks (:meth:`dividing_as` changes it)."""

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
    def where_result_goes(self, call: HookCall) -> str:
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

    def for_call(self, call: HookCall) -> "Arithmetic":
        """The arithmetic of one call: over the group the API passed the hook, where it passed one."""
        return self if call.group is None else dataclasses.replace(self, world_size=call.group.size())

    def native_result(self, call: HookCall, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """What native produces from ``call.input`` (the first of :meth:`candidates`), one collective."""
        return Recompute(call, group, self.world_size, dist.get_rank(group))(self.reduction(call))

    def unreduced(self, call: HookCall, rank: int) -> torch.Tensor:
        """The hook's input as its result would hold it unreduced (this rank's chunk when sharded)."""
        x = call.input.chunk(self.world_size)[rank] if call.sharded else call.input
        return x.to(call.output.dtype)

    def why_not_rounded(self, narrow: torch.dtype, given: torch.dtype) -> str:
        """Why the hook's input (``given``) need not hold values of the ``narrow`` dtype, for the fix of a hook
        that rounds it to ``narrow`` first: ``"a float32 input need not hold bfloat16 values ..."``. An API where
        a parameter dtype makes the inputs hold them in some runs says which runs (FSDP2's comm)."""
        low, own = dtype_name(narrow), dtype_name(given)
        return (f"a {own} input need not hold {low} values, whatever the parameter dtype (a gradient summed over "
                f"micro-batches, or {own} parameters, holds {own} values that {low} rounds)")

    def words(self, call: HookCall, rank: int) -> Words:
        """What this call's causes are worded from (:class:`~conformance.ranks.cause_words.Words`)."""
        return Words(self.world_size, dist.get_world_size() if self.hook_picks_divisor else self.world_size, rank,
                     call.sharded, self.reduce_dtype or call.input.dtype, call.output.dtype, self.reduce_dtype,
                     self.describe(), self.how_to_average(), self.group_arg,
                     lambda n: self.dividing_as(n).describe(), given=call.input.dtype,
                     why_not_rounded=self.why_not_rounded, layout=node_layout(),
                     result_goes=self.where_result_goes(call))

    def changes(self, call: HookCall) -> List[Reduction]:
        """Native's reduction, then each candidate cause as that reduction with one or two fields changed: the
        same list on every rank (it depends on the API, the claim, the world size, the op, the call's shape and the
        job's node layout, :func:`node_layout`)."""
        ws, native = self.world_size, self.reduction(call)
        summed, div, mul = native.plain_sum(), Scale(ws), Scale(ws, reciprocal=True)
        reduce_in = self.reduce_dtype or call.input.dtype
        default_ws = dist.get_world_size() if self.hook_picks_divisor else ws
        out = [native]
        if default_ws != ws:
            # Named before "averaged twice", which it equals bit for bit where both sizes are powers of two.
            as_default = self.dividing_as(default_ws).reduction(call)
            if as_default != native:  # an FSDP2 comm asked for SUM divides nothing, whatever the group's size
                out.append(dataclasses.replace(as_default, group=DEFAULT_GROUP, divides_as=default_ws))
            out.append(dataclasses.replace(summed, post=(Scale(default_ws),), group=DEFAULT_GROUP))
        out += [summed, dataclasses.replace(native, post=native.post + (div,)),
                dataclasses.replace(summed, post=(div,))]
        if not self.divides_before_sum:
            out.append(dataclasses.replace(summed, pre=(div,)))
        # On a job across nodes, a two-level reduction first: on 2 nodes of 2 it is pairwise order too, and there a
        # hierarchical hook is likelier than a tree written by hand.
        out += self.two_level_changes(call, native)
        # A hook that gathers every rank's values (an all-gather, or an all-to-all where it keeps a shard) and
        # sums them itself sums in rank order, not in the collective's order (which need not be rank order at 3
        # or more ranks); a ring all-reduce it writes sums chunk c from rank c on; a tree, pairs of pairs.
        orders = [RANK] + ([RING] if ws >= 3 and not call.sharded else []) + ([PAIRWISE] if ws >= 4 else [])
        for order in orders:
            ordered = dataclasses.replace(summed, order=order)
            out += ([ordered] if order != RANK else []) + [dataclasses.replace(ordered, post=(div,)),
                                                           dataclasses.replace(ordered, pre=(mul,))]
        if ws & (ws - 1):  # x * (1/N) rounds unlike x / N only where N is not a power of two
            out.append(dataclasses.replace(summed, order=RANK, post=(mul,)))
        if reduce_in != call.output.dtype:
            # Where the hook divides matters as much as when: in the reduce dtype or in the gradient's own.
            own = Scale(ws, own_dtype=True)
            out += [dataclasses.replace(summed, post=(own,)), dataclasses.replace(summed, pre=(own,))]
        out += [dataclasses.replace(self, reduce_dtype=other).reduction(call)
                for other in (torch.float32, torch.bfloat16, torch.float16) if other != reduce_in]
        wrong_sizes = [n for n in self.wrong_world_sizes() if n != default_ws]
        out += [dataclasses.replace(self.dividing_as(wrong).reduction(call), divides_as=wrong) for wrong in wrong_sizes]
        # On a job across nodes, the sizes of its layout (LOCAL_WORLD_SIZE, the node count): a divisor read off
        # torchrun's variables ("the ranks I average over"), where the group spans the nodes.
        for n in sorted(set(node_layout() or ()) - {ws, default_ws, 1} - set(wrong_sizes)):
            as_layout = self.dividing_as(n).reduction(call)
            if as_layout != native:  # an FSDP2 comm asked for SUM divides nothing, whatever the size
                out.append(dataclasses.replace(as_layout, divides_as=n))
        if call.sharded:
            out += [dataclasses.replace(native, read=shift) for shift in range(1, ws)]
            out += [dataclasses.replace(native, collective=ALL_REDUCE_THEN_CHUNK, read=shift) for shift in range(ws)]
        out += [dataclasses.replace(native, rounded_to=d) for d in narrower_than(call.input.dtype, reduce_in)]
        return out

    def two_level_changes(self, call: HookCall, native: Reduction) -> List[Reduction]:
        """On a job across nodes (:func:`node_layout`, nodes of two ranks or more) whose every rank is in the hook's
        group, native's reduction summed within each node, then across nodes (order
        :data:`~conformance.ranks.reduction.NODES`, from the values every rank's input is gathered for anyway: no
        collective of its own), as a hook that reduces in two levels does: with native's own scaling, the SUM then
        divided by the world size, or each node's mean averaged over the nodes (a two-level mean, rounded otherwise
        than native); averaged twice across the levels (each node's sum divided by ``LOCAL_WORLD_SIZE``, then the
        whole by the world size, or native's average with a node mean inside); a division missing at one level;
        no division at all. None for a native with no collective, or on one node."""
        layout, ws = node_layout(), self.world_size
        if layout is None or layout[0] < 2 or native.collective == NO_COLLECTIVE or not \
                layout[0] * layout[1] == ws == dist.get_world_size():
            return []
        local, nodes = layout
        summed = dataclasses.replace(native.plain_sum(), order=NODES, node_size=local)
        ordered = [dataclasses.replace(native, order=NODES, node_size=local)] if native.op is None else []
        return ordered + [
            dataclasses.replace(summed, post=(Scale(ws),)),
            dataclasses.replace(summed, between=(Scale(local),), post=(Scale(nodes),)),
            dataclasses.replace(summed, between=(Scale(local),), post=(Scale(ws),))] + [
            dataclasses.replace(o, between=(Scale(local),)) for o in ordered] + [
            dataclasses.replace(summed, between=(Scale(local),)), dataclasses.replace(summed, post=(Scale(nodes),)),
            summed]

    def candidates(self, call: HookCall, group: Optional[dist.ProcessGroup], rank: int) -> List[Candidate]:
        """Every named cause for ``call`` (:class:`Candidate`: the cause, its result, its fix), native first; the
        same collectives, in the same order, on every rank. A change that is native's reduction again, or an
        earlier change again, is left out; the shard of another rank only where the data tells it apart; the
        input rounded to a narrower dtype only where that changes some rank's input (every rank's input is
        gathered once for the hook-ordered sums anyway), and not on a rank where it gives native's bits."""
        recompute, words = Recompute(call, group, self.world_size, rank), self.words(call, rank)
        changes = self.changes(call)
        native, seen, out = changes[0], [], []
        for change in changes:
            if any(change == s and change.op is s.op for s in seen):
                continue
            seen.append(change)
            if change.rounded_to is not None and not _rounding_changes(recompute.gathered(), change.rounded_to):
                continue  # every rank's input holds values of that dtype: the same bits as native, everywhere
            value = recompute(change)  # a collective, on every rank alike: the choice below is this rank's own
            kept = (rank - change.read) % self.world_size
            if change.read and not _chunks_differ(recompute.gathered(words.reduce_in), self.world_size, kept, rank):
                continue  # no data tells the shard of that rank from this rank's
            if change.rounded_to is not None and out and same_bits(value, out[0].value):
                continue  # this rank's result is native's: the rounding vanished in the reduction here
            out.append(Candidate(words.of(native, change), value))
        return out
