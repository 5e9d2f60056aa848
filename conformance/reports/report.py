"""Turning results into words: one place for the failure text and the per-hook verdict.

The runner (:mod:`conformance.controller.runner`) calls this for each failed case and the
pytest plugin for the "hook conformance" summary, so a failure reads the same
whichever API or check produced it: a header naming the hook, check, variant,
model and world size; the findings (rank, step, FQN, bitwise figures) or what
each rank did when it raised, hung or died; the command that re-runs the case.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from conformance.protocol import CaseResult, Cause, Finding
from conformance.reports.results import ShortFigure
from conformance.reports.verdict import Status, Verdict

#: Findings listed in full in one failure message; the rest are counted.
MAX_FINDINGS_SHOWN = 8


def header(hook: Optional[str], describe: Dict[str, Any], world_size: int) -> str:
    """The failure's first line: ``hook H does not conform: check=... world_size=N``; for a case that simulated
    several nodes (``nodes`` in ``describe``), a second line naming the layout it needs
    (:func:`layout_line`)."""
    what = " ".join(f"{k}={v}" for k, v in describe.items())
    who = f"hook {hook}" if hook else "case"
    first = f"{who} does not conform: {what} world_size={world_size}"
    nodes = int(describe.get("nodes", 1))
    return f"{first}\n{layout_line(world_size, nodes)}" if nodes > 1 else first


def layout_line(world_size: int, nodes: int) -> str:
    """How a failure names the simulated node layout it needs: the layout and torchrun's variables as each rank
    had them (:func:`conformance.ranks.topology.torchrun_env`)."""
    local = world_size // nodes
    return (f"  simulated layout: {nodes} nodes of {local} rank{'s' if local != 1 else ''}, on one machine: every "
            f"rank had torchrun's variables as on that job (LOCAL_WORLD_SIZE={local}, LOCAL_RANK=rank % {local}, "
            f"GROUP_RANK=rank // {local}, GROUP_WORLD_SIZE={nodes}, ROLE_RANK, ROLE_WORLD_SIZE={world_size}); a hook "
            "that reads them takes the path it would take across nodes")


def findings_text(found: Sequence[Finding]) -> str:
    """The findings, step by step then rank by rank, one line each; past MAX_FINDINGS_SHOWN, a count.

    Then the diagnosis (findings whose kind :attr:`~conformance.protocol.FindingKind.explains`), every line once,
    with the ranks that gave it.
    """
    observed = [f for f in found if not f.kind.explains]
    ordered = sorted(observed, key=lambda f: (f.step if f.step is not None else -1, f.rank, f.fqn or ""))
    lines = [f"  {f.describe()}" for f in ordered[:MAX_FINDINGS_SHOWN]]
    if len(ordered) > MAX_FINDINGS_SHOWN:
        lines.append(f"  ... and {len(ordered) - MAX_FINDINGS_SHOWN} more findings")
    return "\n".join(lines + diagnosis_lines(found))


def diagnosis_lines(found: Sequence[Finding]) -> List[str]:
    """``Diagnosis:`` and one line per distinct explanation, naming the ranks (and step) that gave it; under it,
    the fix its causes imply (:attr:`Finding.fixes`): ``fix: ...``, one line per distinct fix (naming its
    cause where the causes imply different ones)."""
    ranks: Dict[Tuple[Optional[int], str, Tuple[Cause, ...]], List[int]] = {}
    for f in found:
        if f.kind.explains:
            ranks.setdefault((f.step, f.message, f.causes), []).append(f.rank)
    if not ranks:
        return []
    lines = ["  Diagnosis (each named cause recomputed with the same collectives from the hook's own inputs):"]
    for (step, message, causes), who in sorted(ranks.items(), key=lambda kv: (kv[0][0] or -1, min(kv[1]))):
        who = sorted(set(who))
        label = f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
        lines.append(f"    [{label}{'' if step is None else f', step {step}'}] {message}")
        lines.extend(f"      {line}" for line in fix_lines(causes))
    return lines


#: Fix lines shown under one diagnosis where its causes imply different fixes; the rest are counted.
MAX_FIXES_SHOWN = 2


def fix_lines(causes: Sequence[Cause]) -> List[str]:
    """``fix: ...`` for ``causes``: one line where every cause with a fix implies the same one; else one line per
    distinct fix, ``fix, if SUM, then divided by 3: ...`` (the cause's words up to their first ``", where"`` or
    ``": "``), the first :data:`MAX_FIXES_SHOWN` of them, the rest counted; none where no cause implies a fix."""
    first_cause = {c.fix: c for c in reversed(causes) if c.fix}
    if len(first_cause) <= 1:
        return [f"fix: {fix}" for fix in first_cause]
    lines = [f"fix, if {_short_cause(c.words)}: {c.fix}" for c in causes if c.fix and first_cause.get(c.fix) is c]
    more = len(lines) - MAX_FIXES_SHOWN
    if more > 0:
        lines = lines[:MAX_FIXES_SHOWN] + [f"... and {more} more fix(es), one for each other cause named"]
    return lines


def _short_cause(cause: str) -> str:
    """A cause's leading words: up to its first ``", where"`` or ``": "``."""
    for cut in (", where", ": "):
        if cut in cause:
            cause = cause.split(cut, 1)[0]
    return cause


def failure_message(header: str, body: str, rerun: str) -> str:
    """The whole failure: ``header``, ``body``, then the ``Re-run just this case:`` block."""
    return f"{header}\n{body}\nRe-run just this case:\n  {rerun}"


def rank_problems(result: CaseResult) -> str:
    """What went wrong per rank when a rank raised, hung or died (empty when every rank finished).

    Per rank: its summary line; for a rank that raised, the findings its check had
    gathered by then (``RankOutcome.findings_before_error``), then its traceback; for
    a rank that hung, its stack; else what it printed.
    """
    bad = [o for o in result.outcomes if not o.ok]
    if not bad:
        return ""
    if result.timed_out:
        intro = (f"the case did not finish within the case timeout on {len(bad)} of {result.world_size} ranks "
                 f"(after {result.wall_s:.1f} s); the pool was restarted")
    else:
        intro = f"{len(bad)} of {result.world_size} ranks did not finish the case"
        if result.pool_rebuilt:
            intro += "; the pool was restarted"
    lines = [intro]
    for o in bad:
        lines.append(f"--- {o.summary()} ---")
        if o.findings_before_error:
            lines.append(f"found on rank {o.rank} before it raised:")
            lines.append(findings_text(o.findings_before_error))
        if o.error:
            lines.append(o.error.rstrip())
        if o.stack:
            lines.append(o.stack.rstrip())
        elif o.output.strip():
            lines.append(f"(rank {o.rank} printed during the case:)")
            lines.append(o.output.rstrip())
    return "\n".join(lines)


def exception_line(text: str) -> str:
    """The exception a traceback ends with (its ``Type: message`` line and what follows), on one line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", ln)]
    return " ".join(lines[starts[-1]:][:4]) if starts else (lines[-1] if lines else "(no message)")


def hook_verdict(counts: Mapping[str, int], failed_checks: Iterable[str], ran_at: Iterable[int],
                 interrupted: bool = False, not_run: Sequence[str] = (),
                 known_failure_reasons: Iterable[str] = ()) -> Verdict:
    """One hook's verdict (:class:`~conformance.reports.verdict.Verdict`) from its case outcomes.

    Args:
        counts: outcome -> number of cases (``passed``, ``failed``, ``xfailed``,
            ``xpassed``, ``skipped``).
        failed_checks: the checks of its failed cases.
        ran_at: the world sizes at which its cases ran (skipped ones excluded).
        interrupted: the run was stopped (Ctrl-C, SIGTERM) before every case ran.
        not_run: why some of its cases could not run (the run's own failure, e.g. a rank
            pool that could not start); the verdict is then ``NOT RUN (reason)``
            unless a case of it failed.
        known_failure_reasons: the reasons of its known failures, kept in the verdict.

    ``DOES NOT CONFORM (checks)``; ``NOT RUN`` when every case was skipped;
    ``NOT CHECKED ACROSS RANKS`` when every case ran at world size 1 (a mean
    over one rank is the local gradient); ``known failures``; ``CONFORMS``.
    Known failures that now pass are counted, never hidden. An interrupted run
    keeps a failure's verdict (the failure is real) and says ``INTERRUPTED``
    instead of any other: what did not run may fail.
    """
    now_pass = counts.get("xpassed", 0)
    reasons = tuple(sorted(set(known_failure_reasons)))
    if counts.get("failed"):
        return Verdict(Status.DOES_NOT_CONFORM, failed_checks=tuple(sorted(set(failed_checks))), now_pass=now_pass,
                       known_failure_reasons=reasons)
    if interrupted:
        return Verdict(Status.INTERRUPTED, now_pass=now_pass, known_failure_reasons=reasons)
    if not_run:
        return Verdict(Status.NOT_RUN, not_run_reason=not_run[0], now_pass=now_pass, known_failure_reasons=reasons)
    if not (counts.get("passed") or counts.get("xfailed") or now_pass):
        return Verdict(Status.NOT_RUN, all_skipped=bool(counts.get("skipped")))
    if max(set(ran_at) or {0}) < 2:
        return Verdict(Status.NOT_CHECKED_ACROSS_RANKS, now_pass=now_pass, known_failure_reasons=reasons)
    if counts.get("xfailed"):
        return Verdict(Status.KNOWN_FAILURES, now_pass=now_pass, known_failure_reasons=reasons)
    return Verdict(Status.CONFORMS, now_pass=now_pass, known_failure_reasons=reasons)


def figure(x: float) -> str:
    """A lossy-contract figure for messages: ``1.234e-03`` or ``inf`` (as its JUnit property,
    :class:`~conformance.reports.results.ShortFigure`, writes it)."""
    return str(ShortFigure(x))


def lossy_error_note(worst: Dict[str, Any], bound: Optional[float]) -> str:
    """The closing line of a ``lossy_error`` case: the observed maximum relative error, where, and the bound.

    ``worst`` is the rank's figures with the largest ``max_rel_error``; ``at``
    is ``(step, fqn)`` of it, or ``None``.
    """
    where = "" if worst["at"] is None else f" (step {worst['at'][0]}, parameter {worst['at'][1]!r})"
    return (f"  observed max relative error {figure(worst['max_rel_error'])}{where}; declared rel_error_bound "
            f"{'none' if bound is None else figure(bound)}")


def lossy_loss_note(figures: Dict[str, Any], steps: int, margin: float) -> str:
    """The closing line of a failed ``lossy_loss`` case: both losses and the relative difference against the margin."""
    return (f"  observed relative loss difference {figure(figures['rel_diff'])} after {steps} steps "
            f"(loss {figures['loss_hook']!r} with the hook, {figures['loss_exact']!r} without); declared "
            f"loss_margin {figure(margin)}")
