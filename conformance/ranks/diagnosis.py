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
* SUM without averaging; averaged twice; divided as for the default group's size
  or another world size (two causes of the same bits are both named);
* another rounding order: SUM then divide by the world size, or divide before the
  SUM, where native multiplies by ``1/N`` (DDP's ``Reducer``) or pre- and
  post-divides (FSDP's ``_div_if_needed`` with ``_get_gradient_predivide_factor``);
  a sum the hook computes itself in rank, ring or pairwise order, with a divide or a
  reciprocal multiply before or after it;
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
:attr:`~conformance.ranks.arithmetic.Arithmetic.group_arg`): :class:`Named`, and
:attr:`conformance.protocol.Finding.fixes`. Two causes at once carry both fixes.

A call none of them explains is reported as "no known cause". Candidates run
collectives, so every rank of the group must call :func:`diagnose` at the same
point with the same number of calls; it checks that first and gives up (with a
line saying so) otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.protocol import Finding, FindingKind, cause_key
from conformance.ranks.arithmetic import Arithmetic, Candidate
from conformance.shared.compare import dtype_name, same_bits
# Re-exported: the recorders import what they keep of a call from here.
from conformance.ranks.hook_call import CallLog, HookCall, counting_collectives  # noqa: F401
from conformance.ulps import bits_equal

#: Calls explained per failing step: each costs a dozen collectives, and the first ones tell the cause.
MAX_DIAGNOSED_CALLS = 2


class Named(NamedTuple):
    """A cause that reproduces a hook call's result bit for bit (its words), and the fix it implies (one
    instruction worded for the API; ``""`` where none follows)."""

    cause: str
    fix: str = ""


def _partial(output: torch.Tensor, native: torch.Tensor, local: torch.Tensor) -> Optional[str]:
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
    part = f"the tail from element {first} ({size - first} of {size})" if last == size - 1 else \
        f"elements {first}..{last} ({last - first + 1} of {size})"
    return f"{part} left unreduced (the local gradient), the rest equal to native"


def _nonfinite_replaced(output: torch.Tensor, native: torch.Tensor) -> Optional[str]:
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
    return (f"NaN or Inf replaced: equal to native except at {int(replaced.sum())} element(s) where native is "
            f"NaN/Inf and the hook left {', '.join(repr(v) for v in values)}")


def explain(arith: Arithmetic, call: HookCall, previous: Optional[HookCall], group: Any,
            rank: int) -> List[Named]:
    """Every named cause that reproduces ``call.output`` bit for bit, with its fix (collective: every rank calls it).

    The causes are ``arith``'s (:meth:`~conformance.ranks.arithmetic.Arithmetic.candidates`, native first),
    then what any API's hook may do: return its local gradient, a step's old result, NaN or Inf replaced,
    a range left unreduced; their fixes are worded by ``arith`` too.
    """
    candidates = arith.candidates(call, group, rank)
    out = call.output
    causes = [Named(c.cause, c.fix) for c in candidates if same_bits(out, c.value)]
    native = candidates[0].value
    local = arith.unreduced(call, rank)
    if same_bits(out, local) and not same_bits(native, local):
        if call.collectives:
            causes.append(Named(
                f"the local, unreduced gradient: the hook issued {call.collectives} collective(s), but its result is "
                "the local gradient it received (the reduced values went elsewhere: into a copy the API never reads, "
                "or a buffer it then overwrote with the unreduced result)",
                f"{arith.where_result_goes(call)}: leave the reduced values there, not in a copy or a buffer the API "
                "overwrites afterwards"))
        elif call.collectives == 0:
            causes.append(Named(
                "the local, unreduced gradient: the hook never communicated (no collective was issued on any "
                "process group during the call)",
                f"reduce over the hook's process group ({arith.group_arg}): {arith.how_to_average()}"))
        else:
            causes.append(Named(
                "the local, unreduced gradient: the hook's result is the local gradient it received",
                f"reduce over the hook's process group ({arith.group_arg}): {arith.how_to_average()}"))
    # Stale only where the inputs changed: with the same input, the last step's result is this one's too.
    if previous is not None and previous.output is not None and same_bits(out, previous.output) \
            and not same_bits(out, native) and not same_bits(previous.input, call.input):
        causes.append(Named(
            f"the result of step {previous.step} (stale): the hook returned what it produced a step earlier",
            "reduce each call's own input; keep no result from one step to the next (cached by bucket, size or "
            "position, it is stale once the gradients change)"))
    nonfinite = _nonfinite_replaced(out, native)
    if nonfinite:
        causes.append(Named(nonfinite, "leave NaN and Inf as the reduction gives them: native propagates them, so "
                                       "the loss scaler (or the user) sees the step diverge"))
    partial = None if same_bits(out, local) else _partial(out, native, local)
    if partial:
        causes.append(Named(partial, "pass the whole buffer to the collective: every element must be reduced"))
    if not causes:
        causes.extend(_combined(out, candidates, _local_tails(arith, call, local)))
    return causes


def wrong_group(arith: Arithmetic, call: HookCall, group: Any) -> Optional[Named]:
    """What the hook's own calls show, whatever its result's bits: a collective over the default group where
    the hook's process group (``group``) is smaller (the ``group=`` argument forgotten), with its fix, or
    ``None``."""
    ws, everyone = dist.get_world_size(group), dist.get_world_size()
    if ws == everyone or everyone not in call.group_sizes:
        return None
    return Named(f"the hook ran a collective over the default group ({everyone} ranks: no group= given), where its "
                 f"process group has {ws}: pass the process group the API gives the hook to every collective",
                 f"pass {arith.group_arg} to every collective the hook issues (with no group= it runs over all "
                 f"{everyone} ranks)")


def agreed(causes: List[Named], group: Any) -> List[Named]:
    """``causes`` narrowed to those every rank of ``group`` also found, where some are: a cause that explains one
    rank's result alone is a coincidence of that rank's values (at 2 ranks, rank 1's local gradient can equal
    the SUM), not what the hook did. Causes compare by their text with the numbers left out (each rank names
    its own rank and shard). Collective: an all-gather of the texts."""
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [cause_key(c.cause) for c in causes], group=group)
    common = set.intersection(*(set(c) for c in everyone))
    return [c for c in causes if cause_key(c.cause) in common] if common else causes


def _local_tails(arith: Arithmetic, call: HookCall, local: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """What a part of the buffer a hook never exchanged holds: the local gradient, as it arrived or already
    scaled as the API scales it before the SUM (``1/N``, or ``/N``), in the reduce dtype."""
    ws = arith.world_size
    low = arith.reduce_dtype or call.input.dtype
    return [("the local, unreduced gradient", local),
            (f"the local gradient multiplied by 1/{ws}, never reduced", local.to(low).mul(1.0 / ws).to(local.dtype)),
            (f"the local gradient divided by {ws}, never reduced", local.to(low).div(ws).to(local.dtype))]


def _combined(out: torch.Tensor, bodies: Sequence[Candidate],
              tails: Sequence[Tuple[str, torch.Tensor]]) -> List[Named]:
    """Two causes at once, each explaining a disjoint part of ``out`` bit for bit: the first of ``bodies``
    (native first) that explains some elements, with the first of ``tails`` that explains every other one.
    Named with the index ranges of the second, and with both fixes (the body's where it is not native);
    empty when no pair covers ``out``."""
    for body in bodies:
        if body.value.shape != out.shape or body.value.dtype != out.dtype:
            continue
        rest = ~bits_equal(out, body.value)
        if not bool(rest.any()) or bool(rest.all()):
            continue
        for tail_name, tail in tails:
            if tail.shape == out.shape and tail.dtype == out.dtype and bool(bits_equal(out[rest], tail[rest]).all()):
                where = _ranges(rest)
                elsewhere = "native's result" if body.cause == "native" else body.cause
                fix = f"reduce {where} too: pass the whole buffer to the collective"
                if body.fix:
                    fix += f"; and elsewhere, {body.fix}"
                return [Named(f"two causes: {tail_name} at {where}; elsewhere {elsewhere}", fix)]
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


def diagnose(ctx: Any, arith: Arithmetic, log: CallLog, step: int) -> List[Finding]:
    """The diagnosis of ``step`` on this rank: one finding per group of calls with the same explanation, of
    kind ``"diagnosis"`` (named causes), ``"diagnosis_wider_dtype"`` (only a reduction in a wider dtype
    than claimed explains it: more accurate than native), ``"no_known_cause"``, or ``"native_result"``
    (every call of this rank equals native's arithmetic: what differs arose after the hook returned).

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
    groups: Dict[Tuple[Named, ...], List[HookCall]] = {}
    native_ok: List[HookCall] = []
    observed: Dict[Named, List[HookCall]] = {}
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
        causes = agreed(explain(arith_call, call, previous.get(call.index), group, rank), group)
        seen = wrong_group(arith_call, call, group)
        if seen:
            observed.setdefault(seen, []).append(call)
        if causes and causes[0].cause == "native":
            continue
        groups.setdefault(tuple(causes), []).append(call)
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
        findings.append(Finding(ctx.rank, f"in {where}, {seen.cause}", step=step, kind=FindingKind.DIAGNOSIS,
                                causes=(seen.cause,), fixes=(seen.fix,)))
    for named, which in groups.items():
        where = "every hook call of the step" if len(which) == len(calls) else \
            f"{len(which)} of {len(calls)} hook calls ({_names(which)})"
        if named:
            causes = tuple(n.cause for n in named)
            kind = "diagnosis_wider_dtype" if _only_wider_dtype(causes, arith.reduce_dtype) else "diagnosis"
            findings.append(Finding(ctx.rank, f"in {where}, the hook's result is explained, bit for bit, by: "
                                              f"{'; or '.join(causes)}", step=step, kind=kind, causes=causes,
                                    fixes=tuple(n.fix for n in named)))
        else:
            findings.append(Finding(ctx.rank, f"no known cause explains the hook's result in {where}",
                                    step=step, kind=FindingKind.NO_KNOWN_CAUSE))
    if native_ok and len(native_ok) == len(calls):
        findings.append(Finding(ctx.rank, "the hook's own result equals native's arithmetic bit for bit in every "
                                          "call; what differs arose after the hook returned", step=step,
                                kind=FindingKind.NATIVE_RESULT))
    return findings


def _only_wider_dtype(causes: Sequence[str], claim: Optional[torch.dtype]) -> bool:
    """Whether one of the causes is a reduction in a more precise dtype than the claimed one (finer ``eps``):
    more accurate than native, which may be a lossy design worth a contract rather than a bug. Such a
    diagnosis has kind ``"diagnosis_wider_dtype"``."""
    claimed = torch.finfo(claim or torch.float32).eps
    finer = [f"reduced in {dtype_name(d)}," for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
             if torch.finfo(d).eps < claimed]
    return any(c.startswith(w) for c in causes for w in finer)


def _names(calls: Sequence[HookCall]) -> str:
    shown = ", ".join(c.where for c in calls[:3])
    return shown + (", ..." if len(calls) > 3 else "")
