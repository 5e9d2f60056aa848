"""One story per hook: the causes the diagnosis named across a hook's failed cases, counted once per case."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conformance.reports import results
from conformance.reports.markdown_summary import markdown_summary
from conformance.reports.results import CaseRecord, cause_line, hook_causes, hook_fixes
from tests.test_results import document, overwritten_records


def _failed(name: str, hook: str, *causes: str, fixes=None) -> CaseRecord:
    failure = {"header": "h", "findings": [], "message": "m", "rerun": None, "causes": list(causes)}
    if fixes is not None:
        failure["fixes"] = fixes
    return CaseRecord(id=f"t.py::{name}", name=name, outcome="failed", hook=hook, failure=failure)


def test_causes_are_counted_once_per_failed_case_most_cases_first():
    records = [
        _failed("a[ws2]", "h", "SUM, then divided by 2", "SUM, then divided by 2"),
        _failed("b[ws3]", "h", "SUM, then divided by 3", "the result of step 1 (stale)"),
        _failed("c[ws2]", "h"),
        _failed("d[ws2]", "other", "the result of step 1 (stale)"),
        CaseRecord(id="t.py::e", name="e", outcome="passed", hook="h"),
    ]
    # A case names a cause once; causes that differ only in a number are one family, each counted by its words.
    assert hook_causes(records, "h") == [("SUM, then divided by 2", 1), ("SUM, then divided by 3", 1),
                                         ("the result of step 1 (stale)", 1)]
    assert cause_line(hook_causes(records, "h"), 3) == (
        "most failures explained by: SUM, then divided by 2: 1 case; SUM, then divided by 3: 1 case (2 of 3 failed "
        "cases; 1 other cause(s) named)")
    assert hook_causes(records, "other") == [("the result of step 1 (stale)", 1)]


def test_a_hook_whose_failures_name_no_cause_gets_no_line():
    records = [_failed("a", "h"), CaseRecord(id="t.py::b", name="b", outcome="passed", hook="h")]
    assert hook_causes(records, "h") == []
    assert cause_line(hook_causes(records, "h"), 1) is None


def test_files_of_older_versions_without_causes_still_read():
    old = CaseRecord(id="t.py::a", name="a", outcome="failed", hook="h",
                     failure={"header": "h", "findings": [], "message": "m", "rerun": None})
    assert hook_causes([old], "h") == []


def test_the_markdown_states_the_hooks_cause_from_the_document():
    """The Markdown renders a results file alone: it reads the hook's ``causes`` there, with the count of its
    failed cases, under the hook's heading (and a hook with none gets no line)."""
    records = overwritten_records()
    failed = sum(1 for r in records if r.hook == "overwritten" and r.failing)
    doc = document(records)
    for hook in doc["hooks"]:
        hook["causes"] = ([{"cause": "SUM, then divided by 2", "cases": 4}, {"cause": "the result of step 0 (stale)",
                                                                              "cases": 1}]
                          if hook["name"] == "overwritten" else [])
    jsonschema.validate(doc, results.schema())
    text = markdown_summary(json.loads(json.dumps(doc)))
    section = text.split("### `overwritten`", 1)[1]
    assert (f"Most failures explained by: SUM, then divided by 2 (4 of {failed} failed cases; 1 other cause(s) "
            "named).") in section
    assert text.count("Most failures explained by") == 1


def test_each_cause_keeps_the_fix_its_first_failure_recorded():
    """``hook_fixes``: by the cause, the fix of the first failed case naming it (each world size's cause its own);
    a cause with no fix, or a file from before fixes, has none."""
    records = [
        _failed("a[ws3]", "h", "SUM, then divided by 3", "the result of step 0 (stale)",
                fixes={"SUM, then divided by 3": "multiply by 1/3 first"}),
        _failed("b[ws2]", "h", "SUM, then divided by 2", fixes={"SUM, then divided by 2": "multiply by 1/2 first"}),
        _failed("c[ws2]", "h", "the result of step 0 (stale)"),
    ]
    assert hook_causes(records, "h")[0] == ("SUM, then divided by 3", 1)
    assert hook_fixes(records, "h") == {"SUM, then divided by 3": "multiply by 1/3 first",
                                        "SUM, then divided by 2": "multiply by 1/2 first"}
    assert hook_fixes([_failed("d", "h", "x")], "h") == {}


def test_the_markdown_gives_the_fix_of_the_hooks_main_cause_and_the_schema_takes_fixes():
    records = overwritten_records()
    doc = document(records)
    for hook in doc["hooks"]:
        hook["causes"] = ([{"cause": "SUM without averaging", "cases": 2, "fix": "average: multiply by 1/2 first"}]
                          if hook["name"] == "overwritten" else [])
    failures = [case["failure"] for case in doc["cases"] if case.get("failure")]
    assert failures
    for failure in failures:
        failure["causes"] = ["SUM without averaging"]
        failure["fixes"] = {"SUM without averaging": "average: multiply by 1/2 first"}
    jsonschema.validate(doc, results.schema())
    section = markdown_summary(json.loads(json.dumps(doc))).split("### `overwritten`", 1)[1]
    assert "Most failures explained by: SUM without averaging" in section
    assert "Fix: average: multiply by 1/2 first." in section
    failures[0]["fixes"] = {"SUM without averaging": 3}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, results.schema())


def test_a_summary_counts_each_cause_by_the_cases_it_explains():
    """Issue 48: ``divided by 3`` at 3 ranks and ``divided by 2`` at 2 are each counted by the cases they explain,
    the family of most cases first, the most frequent of it first (its fix is the one shown)."""
    records = ([_failed(f"a{i}[ws2]", "h", "SUM, then divided by 2") for i in range(5)]
               + [_failed(f"b{i}[ws3]", "h", "SUM, then divided by 3") for i in range(3)]
               + [_failed(f"c{i}[ws2]", "h", "the result of step 0 (stale)") for i in range(6)])
    causes = hook_causes(records, "h")
    assert causes == [("SUM, then divided by 2", 5), ("SUM, then divided by 3", 3), ("the result of step 0 (stale)", 6)]
    assert cause_line(causes, 14) == ("most failures explained by: SUM, then divided by 2: 5 cases; SUM, then "
                                      "divided by 3: 3 cases (8 of 14 failed cases; 1 other cause(s) named)")
    assert cause_line([("the result of step 0 (stale)", 6)], 6) == (
        "most failures explained by: the result of step 0 (stale) (6 of 6 failed cases)")
