"""Why a hook's result differs from native: named causes, each tested bit for bit on the hook's own calls.

Every API's recorder keeps, for every call of the hook under test, a
:class:`~conformance.ranks.hook_call.HookCall`: the local gradient the hook received (a clone taken before
the call), the result it produced (FSDP1: its ``output`` shard, or the gradient
it reduced in place under ``NO_SHARD``; DDP: the tensor its future holds; FSDP2:
the comm's output buffer, or the tensor an all-reduce hook left), and how many
``torch.distributed`` collectives it issued. When a case finds a difference,
every rank runs :func:`diagnose` on the calls of the failing step: it
recomputes, **with the same collectives on the same process group**, what each
named cause would have produced from those inputs, and reports every cause
whose result equals the hook's bit for bit.

The causes of a reduction are the API's own :class:`~conformance.ranks.arithmetic.Arithmetic`
(its models hand it over; this module names no API), each native's reduction
with one or two fields changed (:class:`~conformance.ranks.reduction.Reduction`):

* native's own arithmetic (the hook's result is right; the difference arose after it);
* SUM without averaging; averaged twice; divided as for the default group's size,
  another world size, or on a job across nodes a size of its layout (``LOCAL_WORLD_SIZE``,
  the node count: :func:`~conformance.ranks.arithmetic.node_layout`); two causes of the
  same bits are both named;
* another rounding order: SUM then divide by the world size, or divide before the
  SUM, where native multiplies by ``1/N`` (DDP's ``Reducer``) or pre- and
  post-divides (FSDP's ``_div_if_needed`` with ``_get_gradient_predivide_factor``);
  a sum the hook computes itself in rank, ring or pairwise order, with a divide or a
  reciprocal multiply before or after it;
* on a job across nodes, a sum within each node, then across nodes, averaged as native,
  averaged twice across the levels, or with a division missing at one level
  (:meth:`~conformance.ranks.arithmetic.Arithmetic.two_level_changes`); FSDP1's pre-divide
  without its post-divide (a post-divide of ``grad`` after the shard went to ``output``);
* native's arithmetic in another dtype than the one claimed;
* the input rounded to a narrower dtype (cast to it and back) before an otherwise native reduction;
* the shard of another rank (reduce-scatter, or an all-reduce and the wrong chunk);
* an all-reduce then this rank's chunk, where native reduce-scatters (another summation order);
* for an FSDP2 all-reduce hook, a second division or reduction of native HSDP's result.

and here, for every API:

* the result of the previous step (stale);
* the local, unreduced gradient, telling "never communicated" (no collective
  seen) from "communicated, but returned the local gradient" (DDP then copies
  it over whatever the hook reduced);
* NaN or Inf replaced (equal to native except where native is not finite);
* a tail or a range of the buffer left unreduced (first and last differing index).

Each cause comes with the fix it implies, one instruction worded for the API
(the arithmetic's :meth:`~conformance.ranks.arithmetic.Arithmetic.how_to_average`,
:meth:`~conformance.ranks.arithmetic.Arithmetic.where_result_goes` and
:attr:`~conformance.ranks.arithmetic.Arithmetic.group_arg`): a :class:`~conformance.protocol.Cause` (a
stable code and its parameters, its words and its fix), carried to the controller in
:attr:`conformance.protocol.Finding.causes`. Two causes at once carry both fixes.

Where several causes give the hook's bits, the diagnosis names every one of them ("; or "), and where the
call is too small to tell them apart (at most :data:`SMALL_CALL` elements, or every candidate giving the
same bits) it says so in one more line (:func:`too_small`).

A call none of them explains is reported as "no known cause". Candidates run
collectives, so every rank of the group must call :func:`diagnose` at the same
point with the same number of calls; it checks that first and gives up (with a
line saying so) otherwise.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.protocol import Cause, Finding, FindingKind
from conformance.ranks.arithmetic import Arithmetic, Candidate
from conformance.shared.compare import same_bits
from conformance.ranks.hook_call import CallLog, HookCall
from conformance.ulps import bits_equal

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext

#: Calls explained per failing step: each costs a dozen collectives, and the first ones tell the cause.
MAX_DIAGNOSED_CALLS = 2

#: A call of at most this many elements (its buffer, every rank's shards of a reduce-scatter) is too small to tell
#: causes apart: several give the same bits there by chance (a 3-element reduce-scatter at 3 ranks), so the
#: diagnosis says so.
SMALL_CALL = 8


def _partial(output: torch.Tensor, native: torch.Tensor, local: torch.Tensor) -> Optional[Cause]:
    """Where ``output`` equals ``native`` but for one contiguous range that holds the local values."""
    if output.shape != native.shape:
        return None
    # Value equality (-0.0 equals 0.0, any NaN equals any NaN) in the tensors' own dtype: exact, as in float64.
    differs = ~((output == native) | (torch.isnan(output) & torch.isnan(native)))
    idx = differs.nonzero().flatten()
    if idx.numel() == 0:
        return None
    first, last = int(idx[0]), int(idx[-1])
    if not same_bits(output[first:last + 1], local[first:last + 1]):
        return None
    size = output.numel()
    tail = last == size - 1
    part = f"the tail from element {first} ({size - first} of {size})" if tail else \
        f"elements {first}..{last} ({last - first + 1} of {size})"
    return Cause("partial", (("tail", tail), ("first", first), ("last", last), ("size", size)),
                 f"{part} left unreduced (the local gradient), the rest equal to native",
                 "pass the whole buffer to the collective: every element must be reduced")


def _nonfinite_replaced(output: torch.Tensor, native: torch.Tensor) -> Optional[Cause]:
    if output.shape != native.shape or output.dtype != native.dtype:
        return None
    bad = ~torch.isfinite(native)
    if not bool(bad.any()):
        return None
    if not same_bits(torch.where(bad, native, output), native):  # equal wherever native is finite
        return None
    replaced = bad & torch.isfinite(output)
    if not bool(replaced.any()):
        return None
    values = sorted({float(v) for v in output[replaced].double().tolist()})[:3]
    return Cause("nonfinite_replaced", (("elements", int(replaced.sum())),),
                 f"NaN or Inf replaced: equal to native except at {int(replaced.sum())} element(s) where native is "
                 f"NaN/Inf and the hook left {', '.join(repr(v) for v in values)}",
                 "leave NaN and Inf as the reduction gives them: native propagates them, so the loss scaler (or the "
                 "user) sees the step diverge")


def _local_gradient(arith: Arithmetic, call: HookCall) -> Cause:
    """The hook's result is the local gradient it received: told apart by the collectives it issued."""
    reduce_it = f"reduce over the hook's process group ({arith.group_arg}): {arith.how_to_average()}"
    if call.collectives:
        return Cause("local_gradient", (("communicated", True), ("collectives", call.collectives)),
                     f"the local, unreduced gradient: the hook issued {call.collectives} collective(s), but its result "
                     "is the local gradient it received (the reduced values went elsewhere: into a copy the API never "
                     "reads, or a buffer it then overwrote with the unreduced result)",
                     f"{arith.where_result_goes(call)}: leave the reduced values there, not in a copy or a buffer the "
                     "API overwrites afterwards")
    if call.collectives == 0:
        return Cause("local_gradient", (("communicated", False),),
                     "the local, unreduced gradient: the hook never communicated (no collective was issued on any "
                     "process group during the call)", reduce_it)
    return Cause("local_gradient", (), "the local, unreduced gradient: the hook's result is the local gradient it "
                 "received", reduce_it)


def explain(arith: Arithmetic, call: HookCall, previous: Optional[HookCall], group: Optional[dist.ProcessGroup],
            rank: int) -> List[Cause]:
    """Every named cause that reproduces ``call.output`` bit for bit, with its fix (collective: every rank calls it).

    The causes are ``arith``'s (:meth:`~conformance.ranks.arithmetic.Arithmetic.candidates`, native first),
    then what any API's hook may do: return its local gradient, a step's old result, NaN or Inf replaced,
    a range left unreduced; their fixes are worded by ``arith`` too.
    """
    return _explain(arith, call, previous, group, rank)[0]


def _explain(arith: Arithmetic, call: HookCall, previous: Optional[HookCall], group: Optional[dist.ProcessGroup],
             rank: int) -> Tuple[List[Cause], bool]:
    """:func:`explain`'s causes, and whether every one of ``arith``'s candidates (two or more, native aside) gives
    the hook's bits: this call's values tell none of them apart."""
    candidates = arith.candidates(call, group, rank)
    out = call.output
    causes = [c.cause for c in candidates if same_bits(out, c.value)]
    every = len(candidates) > 2 and all(c.cause.code == "native" or same_bits(out, c.value) for c in candidates) \
        and causes[0].code != "native"
    native = candidates[0].value
    local = arith.unreduced(call, rank)
    if same_bits(out, local) and not same_bits(native, local):
        causes.append(_local_gradient(arith, call))
    # Stale only where the inputs changed: with the same input, the last step's result is this one's too.
    if previous is not None and previous.output is not None and same_bits(out, previous.output) \
            and not same_bits(out, native) and not same_bits(previous.input, call.input):
        causes.append(Cause(
            "stale", (("step", previous.step),),
            f"the result of step {previous.step} (stale): the hook returned what it produced a step earlier",
            "reduce each call's own input; keep no result from one step to the next (cached by bucket, size or "
            "position, it is stale once the gradients change)"))
    nonfinite = _nonfinite_replaced(out, native)
    if nonfinite:
        causes.append(nonfinite)
    partial = None if same_bits(out, local) else _partial(out, native, local)
    if partial:
        causes.append(partial)
    if not causes:
        causes.extend(_combined(out, candidates, _local_tails(arith, call, local)))
    return causes, every


def wrong_group(arith: Arithmetic, call: HookCall, group: Optional[dist.ProcessGroup]) -> Optional[Cause]:
    """What the hook's own calls show, whatever its result's bits: a collective over the default group where
    the hook's process group (``group``) is smaller (the ``group=`` argument forgotten), with its fix, or
    ``None``."""
    ws, everyone = dist.get_world_size(group), dist.get_world_size()
    if ws == everyone or everyone not in call.group_sizes:
        return None
    return Cause("wrong_group", (("default_size", everyone), ("group_size", ws)),
                 f"the hook ran a collective over the default group ({everyone} ranks: no group= given), where its "
                 f"process group has {ws}: pass the process group the API gives the hook to every collective",
                 f"pass {arith.group_arg} to every collective the hook issues (with no group= it runs over all "
                 f"{everyone} ranks)")


def agreed(causes: List[Cause], group: Optional[dist.ProcessGroup]) -> List[Cause]:
    """``causes`` narrowed to those every rank of ``group`` also found, where some are: a cause that explains one
    rank's result alone is a coincidence of that rank's values (at 2 ranks, rank 1's local gradient can equal
    the SUM), not what the hook did. Causes compare by their :attr:`~conformance.protocol.Cause.family` (code
    and parameters, the numbers left out: each rank names its own rank and shard). Collective: an all-gather of
    the families."""
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [c.family for c in causes], group=group)
    common = set.intersection(*(set(c) for c in everyone))
    return [c for c in causes if c.family in common] if common else causes


def _local_tails(arith: Arithmetic, call: HookCall, local: torch.Tensor) -> List[Tuple[Cause, torch.Tensor]]:
    """What a part of the buffer a hook never exchanged holds: the local gradient, as it arrived or already
    scaled as the API scales it before the SUM (``1/N``, or ``/N``), in the reduce dtype."""
    ws = arith.world_size
    low = arith.reduce_dtype or call.input.dtype
    return [(Cause("local_gradient", (), "the local, unreduced gradient"), local),
            (Cause("local_gradient", (("pre", "reciprocal"), ("divisor", ws)),
                   f"the local gradient multiplied by 1/{ws}, never reduced"),
             local.to(low).mul(1.0 / ws).to(local.dtype)),
            (Cause("local_gradient", (("pre", "divide"), ("divisor", ws)),
                   f"the local gradient divided by {ws}, never reduced"), local.to(low).div(ws).to(local.dtype))]


def _combined(out: torch.Tensor, bodies: Sequence[Candidate],
              tails: Sequence[Tuple[Cause, torch.Tensor]]) -> List[Cause]:
    """Two causes at once, each explaining a disjoint part of ``out`` bit for bit: the first of ``bodies``
    (native first) that explains some elements, with the first of ``tails`` that explains every other one.
    Named with the index ranges of the second, and with both fixes (the body's where it is not native);
    empty when no pair covers ``out``. Code ``"combined"``, the two causes' families its parameters."""
    for body in bodies:
        if body.value.shape != out.shape or body.value.dtype != out.dtype:
            continue
        rest = ~bits_equal(out, body.value)
        if not bool(rest.any()) or bool(rest.all()):
            continue
        for tail_cause, tail in tails:
            if tail.shape == out.shape and tail.dtype == out.dtype and bool(bits_equal(out[rest], tail[rest]).all()):
                where = _ranges(rest)
                elsewhere = "native's result" if body.cause.code == "native" else body.cause.words
                fix = f"reduce {where} too: pass the whole buffer to the collective"
                if body.fix:
                    fix += f"; and elsewhere, {body.fix}"
                return [Cause("combined", (("part", tail_cause.family), ("elsewhere", body.cause.family)),
                              f"two causes: {tail_cause.words} at {where}; elsewhere {elsewhere}", fix)]
    return []


def _ranges(mask: torch.Tensor, shown: int = 3) -> str:
    """The index ranges where ``mask`` (1-D bool) is set: ``"elements 0..9 and 20..21 (12 of 30)"``."""
    idx = mask.nonzero().flatten()
    breaks = (idx[1:] - idx[:-1] != 1).nonzero().flatten()  # a run ends before each break (tensor ops: millions)
    starts, ends = torch.cat([idx[:1], idx[breaks + 1]]), torch.cat([idx[breaks], idx[-1:]])
    runs: List[Tuple[int, int]] = list(zip(starts[:shown].tolist(), ends[:shown].tolist()))
    text = [f"{a}..{b}" if b > a else str(a) for a, b in runs]
    more = f" and {starts.numel() - shown} more ranges" if starts.numel() > shown else ""
    word = "element" if idx.numel() == 1 else "elements"
    return f"{word} {', '.join(text)}{more} ({idx.numel()} of {mask.numel()})"


#: Whether :func:`diagnose` explains differences in the case running now (:func:`diagnosing`).
_ENABLED = [True]


@contextlib.contextmanager
def diagnosing(enabled: bool) -> Iterator[None]:
    """Explain differences (:func:`diagnose`) inside the block only where ``enabled``. The worker turns it off for
    a case that is a known failure: its failure text is never shown (its known-failure entry's reason is),
    and explaining tens of MiB costs seconds of collectives."""
    saved, _ENABLED[0] = _ENABLED[0], enabled
    try:
        yield
    finally:
        _ENABLED[0] = saved


def diagnose(ctx: CheckContext, arith: Arithmetic, log: CallLog, step: int) -> List[Finding]:
    """The diagnosis of ``step`` on this rank: one finding per group of calls with the same explanation, of
    kind ``"diagnosis"`` (named causes), ``"diagnosis_wider_dtype"`` (only a reduction in a wider dtype
    than claimed explains it: more accurate than native), ``"no_known_cause"``, or ``"native_result"``
    (every call of this rank equals native's arithmetic: what differs arose after the hook returned). A
    diagnosis names every cause that gives the hook's bits (each a :class:`~conformance.protocol.Cause` in
    :attr:`~conformance.protocol.Finding.causes`), followed, where its calls are too small to tell causes
    apart, by a ``"diagnosis_note"`` that says so (:func:`too_small`).

    Collective: every rank of ``ctx.group`` must call it at the same point (or none, where :func:`diagnosing`
    turned it off for the case: it then returns no findings on every rank).
    Returns a single "cannot diagnose" finding when the ranks recorded
    different numbers of calls (the candidates' collectives would not match).
    """
    if not _ENABLED[0]:
        return []
    calls = log.of_step(step)
    counts = torch.tensor([len(calls), -len(calls)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=ctx.group)
    if int(counts[0]) != -int(counts[1]):
        return [Finding(ctx.rank, "not attempted: the ranks recorded different numbers of hook calls in this step",
                        step=step, kind=FindingKind.NO_KNOWN_CAUSE)]
    if not calls:
        return []
    previous = {c.index: c for c in log.calls if c.step == step - 1}
    groups: Dict[Tuple[Cause, ...], List[HookCall]] = {}
    indistinct: Dict[Tuple[Cause, ...], bool] = {}
    native_ok: List[HookCall] = []
    observed: Dict[Cause, List[HookCall]] = {}
    def context(call: HookCall) -> Tuple[Any, int, Arithmetic]:
        # The group the API passed the hook (FSDP2), else the check's: a subgroup context keeps the global
        # rank in ctx.rank, so the rank in the group is asked for.
        group = ctx.group if call.group is None else call.group
        return group, dist.get_rank(group), arith.for_call(call)

    # Phase 1, one collective per call: which calls differ from native on any rank. Phase 2 explains at
    # most MAX_DIAGNOSED_CALLS of those (each costs a dozen collectives).
    differs = torch.tensor([0 if same_bits(c.output, context(c)[2].native_result(c, context(c)[0])) else 1
                            for c in calls], dtype=torch.int64, device=ctx.device)
    mine = differs.clone()
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=ctx.group)
    chosen = [c for c, d in zip(calls, differs.tolist()) if d][:MAX_DIAGNOSED_CALLS]
    skipped = int(differs.sum()) - len(chosen)
    for call in chosen:
        group, rank, arith_call = context(call)
        found, every = _explain(arith_call, call, previous.get(call.index), group, rank)
        causes = agreed(found, group)
        seen = wrong_group(arith_call, call, group)
        if seen:
            observed.setdefault(seen, []).append(call)
        if causes and causes[0].code == "native":
            continue
        groups.setdefault(tuple(causes), []).append(call)
        indistinct[tuple(causes)] = indistinct.get(tuple(causes), False) or every
    if not int(mine.sum()):
        native_ok = list(calls)
    findings: List[Finding] = []
    if skipped:
        findings.append(Finding(ctx.rank, f"{skipped} more hook call(s) of the step differ from native on some rank; "
                                          f"the diagnosis explains the first {MAX_DIAGNOSED_CALLS}", step=step,
                                kind=FindingKind.DIAGNOSIS_NOTE))
    for seen, which in observed.items():
        where = "every hook call of the step" if len(which) == len(calls) else \
            f"{len(which)} of {len(calls)} hook calls ({_names(which)})"
        findings.append(Finding(ctx.rank, f"in {where}, {seen.words}", step=step, kind=FindingKind.DIAGNOSIS,
                                causes=(seen,)))
    for named, which in groups.items():
        where = "every hook call of the step" if len(which) == len(calls) else \
            f"{len(which)} of {len(calls)} hook calls ({_names(which)})"
        if named:
            kind = FindingKind.DIAGNOSIS_WIDER_DTYPE if _only_wider_dtype(named, arith.reduce_dtype) else \
                FindingKind.DIAGNOSIS
            findings.append(Finding(ctx.rank, f"in {where}, the hook's result is explained, bit for bit, by: "
                                              f"{'; or '.join(n.words for n in named)}", step=step, kind=kind,
                                    causes=named))
            alike = too_small(which, named, indistinct.get(named, False))
            if alike:
                findings.append(Finding(ctx.rank, alike, step=step, kind=FindingKind.DIAGNOSIS_NOTE))
        else:
            findings.append(Finding(ctx.rank, f"no known cause explains the hook's result in {where}",
                                    step=step, kind=FindingKind.NO_KNOWN_CAUSE))
    if native_ok and len(native_ok) == len(calls):
        findings.append(Finding(ctx.rank, "the hook's own result equals native's arithmetic bit for bit in every "
                                          "call; what differs arose after the hook returned", step=step,
                                kind=FindingKind.NATIVE_RESULT))
    return findings


def too_small(calls: Sequence[HookCall], causes: Sequence[Cause], indistinct: bool = False) -> Optional[str]:
    """The line that says ``calls`` (explained by ``causes``) cannot tell causes apart, or ``None``: a call whose
    buffer (the hook's input: every rank's shards of a reduce-scatter) has at most :data:`SMALL_CALL` elements,
    where several causes give the same bits by chance (and a cause the diagnosis does not name may too), or a
    call where every candidate cause gave the hook's bits (``indistinct``: its values tell none apart, as powers
    of two or zeros do)."""
    small = [c for c in calls if c.input.numel() <= SMALL_CALL]
    these = "these causes give" if len(causes) > 1 else "other causes may give"
    if small:
        n = min(c.input.numel() for c in small)
        who = "this call has" if len(calls) == 1 else f"{len(small)} of these {len(calls)} calls have"
        return f"{who} only {n} element{'s' if n != 1 else ''}: {these} the same bits here; a larger buffer tells " \
               "them apart"
    if indistinct and len(causes) > 1:
        return ("every cause tried gives the same bits on this call's values: these causes give the same bits here; "
                "values that differ more from rank to rank tell them apart")
    return None


def _only_wider_dtype(causes: Sequence[Cause], claim: Optional[torch.dtype]) -> bool:
    """Whether one of the causes is a reduction (code ``"other_dtype"``) in a more precise dtype than the claimed
    one (finer ``eps``): more accurate than native, which may be a lossy design worth a contract rather than a
    bug. Such a diagnosis has kind ``"diagnosis_wider_dtype"``."""
    claimed = torch.finfo(claim or torch.float32).eps
    dtypes = [getattr(torch, str(c.param("dtype")), None) for c in causes if c.code == "other_dtype"]
    return any(isinstance(d, torch.dtype) and torch.finfo(d).eps < claimed for d in dtypes)


def _names(calls: Sequence[HookCall]) -> str:
    shown = ", ".join(c.where for c in calls[:3])
    return shown + (", ..." if len(calls) > 3 else "")
