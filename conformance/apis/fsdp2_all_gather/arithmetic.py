"""What a custom all-gather comm must produce, and the causes that explain a wrong gather, bit for bit.

An all-gather only moves data: FSDP2 copies this rank's flat shard into its
slot of the comm's output (``all_gather_copy_in``; ``input_tensor`` is a view
of ``output_tensor``), and the comm must leave the shards of the group FSDP2
passed, in the group's rank order, in ``output_tensor``: bit for bit, whatever
the values (NaN payloads, ``-0.0``, subnormals). :func:`explain` names what a
wrong output is instead (:data:`CAUSES`), from this rank's recorded call alone
(the expected gather, recomputed over the same group, is in the call): the
shards in reverse rank order, a collective over another group (the default
one), a cast on the wire, a stale gather served again, the shards at other offsets
(padding kept or dropped between them, or the tail of each not gathered), the chunks indexed by the global
rank. The gradient diagnosis
(:mod:`conformance.ranks.diagnosis`) has no reduction to recompute here:
:class:`AllGatherArithmetic` says so, and the recorder's log stays empty.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from conformance.protocol import Cause
from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.reduction import NO_COLLECTIVE, Reduction

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.hook_call import HookCall

#: The integer dtype of each element size: floats are compared by their bits (every NaN payload counts).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: The dtypes a comm might cast the shards to on the wire.
WIRE_DTYPES = (torch.bfloat16, torch.float16)
#: The fix of a gather that is not the group's shards in rank order.
FIX = ("all-gather input_tensor over group=group (the group FSDP2 passes the comm) into output_tensor, chunk r "
       "from the rank r of that group, in the dtype FSDP2 passed, on every call (as DefaultAllGather: "
       "dist.all_gather_into_tensor(output_tensor, input_tensor, group=group))")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its element size (floats by their bits), 1-D, on the CPU."""
    t = t.detach().reshape(-1).cpu()
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bits (NaN payloads and the sign of zero included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def first_difference(got: torch.Tensor, want: torch.Tensor, group_size: int) -> str:
    """Where ``got`` first differs from ``want`` (both 1-D, ``group_size`` chunks): the chunk (whose rank of the
    group) and the element, with both values."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"it is {tuple(got.shape)} in {got.dtype}, the gather is {tuple(want.shape)} in {want.dtype}"
    where = (bits(got) != bits(want)).nonzero()
    if not len(where):
        return "no element differs"
    i = int(where[0])
    chunk = max(1, want.numel() // max(1, group_size))
    return (f"first at element {i} (chunk {i // chunk}, the shard of rank {i // chunk} of the group, element "
            f"{i % chunk}): {got[i].item()!r} ({_hex(got, i)}) where the shard holds {want[i].item()!r} "
            f"({_hex(want, i)})")


def _hex(t: torch.Tensor, i: int) -> str:
    """The bits of element ``i`` of ``t``, in hex (a NaN's payload shows)."""
    value = int(bits(t)[i]) & ((1 << (8 * t.element_size())) - 1)
    return f"0x{value:0{2 * t.element_size()}x}"


@dataclasses.dataclass
class GatherCall:
    """One recorded call of the comm on this rank.

    Attributes:
        step, index: the training step and the call's position in it.
        output: what the comm left in ``output_tensor``, 1-D (cloned once the call completed).
        expected: the shards of the group's ranks in rank order, gathered again by the recorder over the group
            FSDP2 passed (``all_gather_into_tensor``), 1-D, the output's dtype.
        group_size: the size of that group.
        other_groups: the sizes of the groups of the comm's own collectives that were not that group's.
        previous: what the comm produced in the call of the same index in the step before, or ``None``.
        ranks: the global ranks of that group, in the group's rank order (``dist.get_process_group_ranks``);
            empty where unknown.
    """

    step: int
    index: int
    output: torch.Tensor
    expected: torch.Tensor
    group_size: int
    other_groups: Tuple[int, ...] = ()
    previous: Optional[torch.Tensor] = None
    ranks: Tuple[int, ...] = ()


def _reversed(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.cat(list(reversed(t.chunk(group_size)))) if group_size > 1 else t


#: ``(code, what it means)`` of each cause :func:`explain` tries, in order (the code of its
#: :class:`~conformance.protocol.Cause`).
CAUSES = (
    ("wrong_group", "a collective over a group other than the one FSDP2 passed (the default group, with no group=)"),
    ("reversed_shards", "the shards in reverse rank order (chunk r from rank world_size - 1 - r)"),
    ("wire_dtype", "the shards cast to a narrower dtype on the wire and back"),
    ("stale", "the gather of the step before (stale: served again from a cache, the parameters have changed)"),
    ("bits_changed", "the same values with other bits (a NaN's payload or a zero's sign changed: arithmetic on the "
                   "gathered values, such as x * 1.0 or x + 0.0)"),
    ("by_global_rank", "the chunks indexed by the global rank modulo the group size, not the rank in the group"),
    ("shard_offsets", "the shards at other offsets (padding kept or dropped between them), or the tail of "
                           "each not gathered"),
)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as values where NaN counts as NaN: what arithmetic that changes only bits leaves."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.isnan(), b.isnan())) and \
        bool((a[~a.isnan()] == b[~b.isnan()]).all())


def explain(call: GatherCall) -> Optional[Cause]:
    """The cause of a wrong ``call``, the first of :data:`CAUSES` that reproduces its output bit for bit (a wrong
    group: one of the comm's collectives ran over another group), with its fix, or ``None``."""
    g = call.group_size
    if call.other_groups:
        sizes = ", ".join(map(str, sorted(set(call.other_groups))))
        return Cause("wrong_group", (("group_size", g),),
                     f"a collective over a group of {sizes} ranks where FSDP2 passed the comm a group of {g} (a "
                     "collective with no group= runs over the default group)",
                     "pass group=group (the group FSDP2 passes the comm) to every collective of the comm")
    if g > 1 and same_bits(call.output, _reversed(call.expected, g)):
        return Cause("reversed_shards", (("group_size", g),),
                     f"the shards in reverse rank order (chunk r holds the shard of rank {g - 1} - r of the group)",
                     "put the shard of rank r of the group in chunk r (rank order)")
    for wire in WIRE_DTYPES:
        if wire != call.expected.dtype and call.expected.is_floating_point() and \
                same_bits(call.output, call.expected.to(wire).to(call.expected.dtype)):
            low, own = str(wire).replace("torch.", ""), str(call.expected.dtype).replace("torch.", "")
            return Cause("wire_dtype", (("dtype", low), ("own", own)),
                         f"the shards cast to {low} on the wire and back to {own}",
                         "gather input_tensor in its own dtype (FSDP2 passes it in the parameter dtype; an all-gather "
                         "only moves data)")
    if call.previous is not None and same_bits(call.output, call.previous):
        return Cause("stale", (("step", call.step - 1),),
                     f"the gather of step {call.step - 1} (stale: served again, while the parameters changed at the "
                     "optimizer step)", "gather on every call: FSDP2 re-gathers after every optimizer step, and "
                     "between the forward and the backward where it resharded")
    if call.expected.is_floating_point() and _same_values(call.output, call.expected):
        return Cause("bits_changed", (),
                     "the same values with other bits (a NaN's payload or a zero's sign changed: arithmetic on the "
                     "gathered values, such as x * 1.0 or x + 0.0)",
                     "copy the shards as they are: no arithmetic on the gathered output (an all-gather only moves "
                     "data)")
    return _by_global_rank(call) or _offsets(call)


#: The most places :func:`_offsets` tries for the second shard (where its first elements occur in the output).
MAX_OFFSET_CANDIDATES = 64
#: The fix of a shard at a wrong offset, or a tail not gathered.
OFFSET_FIX = ("put the shard of rank r of the group at elements [r * n, (r + 1) * n) of output_tensor, n = "
              "input_tensor.numel(), every element of it: strip any padding the wire added before copying out, "
              "and gather the last, shorter piece of a chunk loop too")


def _by_global_rank(call: GatherCall) -> Optional[Cause]:
    """The shard of each rank of the group in chunk ``global rank % group size`` (the last or the first one written
    where two share a chunk; a chunk no rank maps to is not compared), where that is not its rank in the group: the
    index a comm computes from ``dist.get_rank()`` instead of ``dist.get_rank(group)``. On a 1-D mesh over the
    pool, and on HSDP's shard groups of consecutive ranks, the two agree; on a data-parallel sub-mesh ({0,2}
    and {1,3}) they do not."""
    g, ranks = call.group_size, call.ranks
    slots = [r % g for r in ranks]
    if g < 2 or len(ranks) != g or slots == list(range(g)):
        return None
    chunk = call.expected.numel() // g
    fits = []
    for order in (list(enumerate(slots)), list(enumerate(slots))[::-1]):  # the last, or the first, writer kept
        want = bits(call.output).clone()
        for j, slot in order:
            want[slot * chunk:(slot + 1) * chunk] = bits(call.expected)[j * chunk:(j + 1) * chunk]
        fits.append(torch.equal(want, bits(call.output)))
    if not any(fits):
        return None
    placed = ", ".join(f"rank {j} of the group (global rank {r}) in chunk {r % g}" for j, r in enumerate(ranks))
    return Cause("by_global_rank", (("group_size", g),),
                 f"the chunks indexed by the global rank modulo the group size, not the rank in the group ({placed}; "
                 "the order by global rank, where the group's ranks are not 0..n-1)",
                 "index the chunks by the rank in the group (dist.get_rank(group), the position in "
                 "dist.get_process_group_ranks(group)), not by dist.get_rank()")


def _offsets(call: GatherCall) -> Optional[Cause]:
    """The shards at other offsets, or the tail of each not gathered, bit for bit where the output holds them:
    each shard's first ``k`` elements in its chunk and the rest not (a chunk loop that dropped its last, shorter
    piece), or shard ``r`` at ``r * t`` for one stride ``t`` other than the shard size ``n`` (``t > n``: padding
    of ``t - n`` elements kept after each shard, the last shard cut off; ``t < n``: the shards overlap, padding
    dropped that was not there)."""
    g, total = call.group_size, call.expected.numel()
    n = total // max(g, 1)
    if g < 2 or n < 2 or call.output.shape != call.expected.shape or call.output.dtype != call.expected.dtype:
        return None
    got, want = bits(call.output), bits(call.expected)
    differ = (got != want).nonzero().reshape(-1)
    if not len(differ):
        return None
    within = differ % n
    kept = int(within.min())
    tail = torch.zeros(g, dtype=torch.bool)
    tail[differ // n] = True
    if kept > 0 and 2 * len(differ) >= n - kept:  # most of a tail differs (not a few elements after a shard's head)
        return Cause("shard_tails", (("kept", kept), ("shard_size", n)),
                     f"the shards' tails not gathered: elements {kept} to {n - 1} of each shard's chunk (of {n}) are "
                     f"not the shard's, the first {kept} are (a chunk loop that drops its last, shorter piece: "
                     f"{n - kept} elements, in {int(tail.sum())} of {g} chunks)", OFFSET_FIX)
    head = want[n:n + min(8, n)]
    places = (got[:total - len(head) + 1] == head[0]).nonzero().reshape(-1)[:MAX_OFFSET_CANDIDATES]
    for t in (int(p) for p in places):
        if t == n or not torch.equal(got[t:t + len(head)], head):
            continue
        if all(torch.equal(got[r * t:min(r * t + n, total)], want[r * n:r * n + min(n, total - r * t)])
               for r in range(g) if r * t < total):
            kind = (f"padding of {t - n} elements kept after each shard, the last shard cut off" if t > n else
                    f"the shards overlapping by {n - t} elements (padding dropped that was not there)")
            return Cause("shard_offsets", (("stride", t), ("shard_size", n)),
                         f"the shards at other offsets: shard r of the group at element r * {t}, not r * {n} ({kind})",
                         OFFSET_FIX)
    return None


def findings_text(call: GatherCall) -> List[str]:
    """The messages of a wrong ``call``: what differs, then the cause and its fix (or that none explains it);
    :func:`explain` tells which."""
    head = (f"call {call.index}: the comm's output_tensor ({call.output.numel()} elements) is not the shards of the "
            f"{call.group_size} ranks of the group FSDP2 passed, in rank order, bit for bit: "
            f"{first_difference(call.output, call.expected, call.group_size)}")
    found = explain(call)
    if found is None:
        names = "; ".join(text for _, text in CAUSES)
        return [head, f"no known cause reproduces it (tried: {names}); fix: {FIX}"]
    return [head, f"explained, bit for bit, by {found.words}; fix: {found.fix}"]


@dataclasses.dataclass(frozen=True)
class AllGatherArithmetic(Arithmetic):
    """No reduction to recompute: the comm moves parameters, and its recorder checks every gather itself
    (:mod:`conformance.apis.fsdp2_all_gather.recorder`); the gradient diagnosis finds no call in its log."""

    def reduction(self, call: HookCall) -> Reduction:
        return Reduction(collective=NO_COLLECTIVE)

    def describe(self) -> str:
        return "FSDP2 asks the comm to all-gather the parameter shards of the group it passes, in rank order"

    group_arg = "group=group (the group FSDP2 passes the comm)"

    def how_to_average(self) -> str:
        return "average nothing: an all-gather only moves the parameter shards"

    def where_result_goes(self, call: HookCall) -> str:
        return "gather into the output_tensor FSDP2 passes the comm (FSDP2 copies the parameters out of it)"
