"""Tests for conformance.reports.report: the per-hook verdict and the failure text's shape."""

from __future__ import annotations

import pytest

from conformance.reports import report
from conformance.protocol import Finding, FindingKind


@pytest.mark.parametrize("counts, failed, ran_at, verdict", [
    ({"passed": 9}, (), {2, 3}, "CONFORMS"),
    ({"passed": 9, "xpassed": 2}, (), {2, 3}, "CONFORMS; 2 known failure(s) now pass"),
    ({"passed": 3, "xfailed": 4}, (), {2}, "known failures"),
    ({"xfailed": 4, "xpassed": 1}, (), {2}, "known failures; 1 known failure(s) now pass"),
    ({"passed": 3, "failed": 1, "xfailed": 1}, ("parity", "averaging"), {2}, "DOES NOT CONFORM (averaging, parity)"),
    ({"passed": 5}, (), {1}, "NOT CHECKED ACROSS RANKS (every case ran at world size 1)"),
    ({"failed": 1}, ("parity",), {1}, "DOES NOT CONFORM (parity)"),  # a failure at one rank is still a failure
    ({"skipped": 6}, (), set(), "NOT RUN: every case was skipped"),
    ({}, (), set(), "not run"),
])
def test_hook_verdict(counts, failed, ran_at, verdict):
    assert report.hook_verdict(counts, failed, ran_at).text == verdict
    assert str(report.hook_verdict(counts, failed, ran_at)) == verdict


@pytest.mark.parametrize("counts, failed, verdict", [
    ({"passed": 9}, (), "INTERRUPTED: no verdict"),            # what did not run may fail
    ({"xfailed": 2, "xpassed": 1}, (), "INTERRUPTED: no verdict; 1 known failure(s) now pass"),
    ({"passed": 3, "failed": 1}, ("parity",), "DOES NOT CONFORM (parity)"),  # a failure found is real
])
def test_an_interrupted_run_gives_no_hook_a_conforming_verdict(counts, failed, verdict):
    assert report.hook_verdict(counts, failed, {2, 3}, interrupted=True).text == verdict


def test_failure_message_ends_with_the_rerun_block():
    msg = report.failure_message(report.header("h", {"check": "parity", "model": "m"}, 3),
                                 report.findings_text([Finding(1, "gradient differs", step=0, fqn="w")]),
                                 "conform -k 'x'")
    assert msg.splitlines() == ["hook h does not conform: check=parity model=m world_size=3",
                                "  [rank 1, step 0, parameter 'w'] gradient differs",
                                "Re-run just this case:", "  conform -k 'x'"]


def test_findings_past_the_limit_are_counted():
    found = [Finding(r, "differs", step=0) for r in range(report.MAX_FINDINGS_SHOWN + 3)]
    lines = report.findings_text(found).splitlines()
    assert len(lines) == report.MAX_FINDINGS_SHOWN + 1 and lines[-1] == "  ... and 3 more findings"


def test_exception_line_keeps_the_error_and_its_continuation():
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: Cannot writeback\n"
          "Expects torch.Size([32])\n")
    assert report.exception_line(tb) == "RuntimeError: Cannot writeback Expects torch.Size([32])"


def test_diagnosis_follows_the_findings_once_per_explanation_with_its_ranks():
    """Every rank diagnoses itself; the report lists each explanation once, naming the ranks, after all
    observed findings (never cut by the findings limit)."""
    from conformance.reports.report import MAX_FINDINGS_SHOWN, findings_text

    observed = [Finding(r, "gradient differs", step=0, fqn=f"p{i}") for r in (0, 1) for i in range(MAX_FINDINGS_SHOWN)]
    diag = [Finding(r, "explained by: SUM without averaging", step=0, kind="diagnosis") for r in (0, 1)]
    text = findings_text(diag + observed)
    lines = text.splitlines()
    assert lines[-1] == "    [ranks 0, 1, step 0] explained by: SUM without averaging"
    assert lines[-2].startswith("  Diagnosis")
    assert "more findings" in lines[-3]
    assert all(f.kind.explains and f.kind.names_a_bug for f in diag)
    assert not FindingKind.NO_KNOWN_CAUSE.names_a_bug and FindingKind.NO_KNOWN_CAUSE.explains


def test_findings_gathered_before_a_rank_raised_lead_its_traceback():
    from conformance.protocol import Case, CaseResult, RankOutcome

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: Check failed (384 vs. 320)"
    raised = RankOutcome(rank=1, error=tb, error_type="RuntimeError", phase="step 0: backward",
                         findings_before_error=[Finding(1, "comm.allocate(size=(68,)) returned shape (128,)", step=0)])
    result = CaseResult(case=Case("c", None, {}), world_size=2, outcomes=(RankOutcome(rank=0, ok=True), raised))
    assert report.rank_problems(result).splitlines() == [
        "1 of 2 ranks did not finish the case",
        "--- rank 1: raised RuntimeError during 'step 0: backward' ---",
        "found on rank 1 before it raised:",
        "  [rank 1, step 0] comm.allocate(size=(68,)) returned shape (128,)",
        *tb.splitlines(),
    ]


def test_a_rank_context_reports_what_its_check_registered():
    import torch

    from conformance.ranks.worker import RankContext

    ctx = RankContext(0, 1, None, torch.device("cpu"), "gloo")
    assert ctx.findings_before_error() == []
    found = [Finding(0, "allocate returned the wrong shape", step=2)]
    ctx.report_on_error(lambda: found)
    assert ctx.findings_before_error() == found
    ctx.report_on_error(lambda: 1 / 0)  # a broken collector never hides the check's own error
    assert ctx.findings_before_error() == []
    ctx.report_on_error(None)
    assert ctx.findings_before_error() == []


def test_the_fix_each_cause_implies_stands_under_the_diagnosis_once_per_distinct_fix():
    """A diagnosis line is followed by ``fix: ...``; ranks with the same causes and fixes share one line; causes that
    imply different fixes each get theirs, named by the cause's leading words; a cause with none gets no line."""
    from conformance.reports.report import findings_text

    same = [Finding(r, "explained by: SUM, then divided by 3", step=0, kind="diagnosis",
                    causes=("SUM, then divided by 3, where DDP with no hook multiplies by 1/3 before the SUM",),
                    fixes=("multiply the bucket by 1/3 before the all-reduce",)) for r in (0, 1)]
    lines = findings_text(same).splitlines()
    assert lines[-2:] == ["    [ranks 0, 1, step 0] explained by: SUM, then divided by 3",
                          "      fix: multiply the bucket by 1/3 before the all-reduce"]
    two = Finding(2, "explained by: A; or B; or C", step=1, kind="diagnosis",
                  causes=("A, where native does X", "B: the detail", "C"), fixes=("do a", "do b", "do a"))
    assert findings_text([two]).splitlines()[-2:] == ["      fix, if A: do a", "      fix, if B: do b"]
    many = Finding(2, "explained by: A; or B; or C; or D", step=1, kind="diagnosis", causes=("A", "B", "C", "D"),
                   fixes=("do a", "do b", "do c", "do d"))
    assert findings_text([many]).splitlines()[-3:] == ["      fix, if A: do a", "      fix, if B: do b",
                                                       "      ... and 2 more fix(es), one for each other cause named"]
    none = Finding(0, "explained by: native", step=0, kind="diagnosis", causes=("x",), fixes=("",))
    assert findings_text([none]).splitlines()[-1] == "    [rank 0, step 0] explained by: native"
