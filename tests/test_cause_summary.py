"""One story per hook: the causes the diagnosis named across a hook's failed cases, counted once per case."""

from __future__ import annotations

from conformance.reports.results import CaseRecord, cause_line, hook_causes


def _failed(name: str, hook: str, *causes: str) -> CaseRecord:
    return CaseRecord(id=f"t.py::{name}", name=name, outcome="failed", hook=hook,
                      failure={"header": "h", "findings": [], "message": "m", "rerun": None, "causes": list(causes)})


def test_causes_are_counted_once_per_failed_case_most_cases_first():
    records = [
        _failed("a[ws2]", "h", "SUM, then divided by 2", "SUM, then divided by 2"),
        _failed("b[ws3]", "h", "SUM, then divided by 3", "the result of step 1 (stale)"),
        _failed("c[ws2]", "h"),
        _failed("d[ws2]", "other", "the result of step 1 (stale)"),
        CaseRecord(id="t.py::e", name="e", outcome="passed", hook="h"),
    ]
    # The world size in a cause's words does not make it another cause; a case names a cause once.
    assert hook_causes(records, "h") == [("SUM, then divided by 2", 2), ("the result of step 1 (stale)", 1)]
    assert cause_line(records, "h") == ("most failures explained by: SUM, then divided by 2 "
                                        "(2 of 3 failed cases; 1 other cause(s) named)")
    assert hook_causes(records, "other") == [("the result of step 1 (stale)", 1)]


def test_a_hook_whose_failures_name_no_cause_gets_no_line():
    records = [_failed("a", "h"), CaseRecord(id="t.py::b", name="b", outcome="passed", hook="h")]
    assert hook_causes(records, "h") == []
    assert cause_line(records, "h") is None


def test_files_of_older_versions_without_causes_still_read():
    old = CaseRecord(id="t.py::a", name="a", outcome="failed", hook="h",
                     failure={"header": "h", "findings": [], "message": "m", "rerun": None})
    assert hook_causes([old], "h") == []
