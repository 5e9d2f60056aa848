"""The per-hook verdict is a value: every status the results schema allows comes from a verdict that the
code building verdicts builds, and its text is the wording the reports print."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.reports import report, results
from conformance.reports.verdict import Status, Verdict

#: One verdict per way the suite builds one, with the status and text it must have.
BUILT = [
    (lambda: report.hook_verdict({"passed": 9}, (), {2, 3}), Status.CONFORMS, "CONFORMS"),
    (lambda: report.hook_verdict({"passed": 3, "xfailed": 4, "xpassed": 1}, (), {2}, known_failure_reasons=["b", "a"]),
     Status.KNOWN_FAILURES, "known failures; 1 known failure(s) now pass"),
    (lambda: report.hook_verdict({"failed": 2, "passed": 1}, ["parity", "averaging", "parity"], {2}),
     Status.DOES_NOT_CONFORM, "DOES NOT CONFORM (averaging, parity)"),
    (lambda: report.hook_verdict({"passed": 5}, (), {1}), Status.NOT_CHECKED_ACROSS_RANKS,
     "NOT CHECKED ACROSS RANKS (every case ran at world size 1)"),
    (lambda: report.hook_verdict({"skipped": 3}, (), set(), not_run=["its rank pool could not start"]),
     Status.NOT_RUN, "NOT RUN (its rank pool could not start)"),
    (lambda: report.hook_verdict({"skipped": 3}, (), set()), Status.NOT_RUN, "NOT RUN: every case was skipped"),
    (lambda: report.hook_verdict({}, (), set()), Status.NOT_RUN, "not run"),
    (lambda: report.hook_verdict({"passed": 2}, (), {2}, interrupted=True), Status.INTERRUPTED,
     "INTERRUPTED: no verdict"),
    (lambda: Verdict.running(3), Status.RUNNING, "RUNNING: 3 case(s) so far"),
    (lambda: Verdict(Status.OTHER), Status.OTHER, ""),  # a hook no summary gave a verdict
]


@pytest.mark.parametrize("build, status, text", BUILT)
def test_a_built_verdict_has_its_status_and_todays_words(build, status, text):
    verdict = build()
    assert (verdict.status, verdict.text, str(verdict)) == (status, text, text)


def test_every_status_the_schema_allows_comes_from_a_built_verdict():
    allowed = results.schema()["$defs"]["hook"]["properties"]["status"]["enum"]
    assert {s.value for s in Status} == set(allowed)
    assert {build().status.value for build, _, _ in BUILT} == set(allowed)


def test_the_verdict_keeps_its_checks_and_known_failure_reasons_sorted_and_is_frozen():
    verdict = report.hook_verdict({"failed": 1, "xfailed": 2}, ["z", "a"], {2}, known_failure_reasons=["y", "x", "y"])
    assert verdict.failed_checks == ("a", "z") and verdict.known_failure_reasons == ("x", "y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.status = Status.CONFORMS  # type: ignore[misc]


def test_a_failure_outranks_an_interruption_and_a_run_that_could_not_start():
    verdict = report.hook_verdict({"failed": 1}, ["parity"], {2}, interrupted=True, not_run=["pool"])
    assert verdict.status is Status.DOES_NOT_CONFORM
