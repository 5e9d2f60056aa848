"""One story per hook: the causes the diagnosis named across a hook's failed cases, counted once per case."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conformance.reports import results
from conformance.reports.markdown_summary import markdown_summary
from conformance.protocol import Cause, Finding
from conformance.reports.results import CaseRecord, cause_fields, cause_line, hook_causes, hook_families, hook_fixes
from tests.test_results import document, overwritten_records

#: The family of each cause named below, as the rank side gives it (:attr:`conformance.protocol.Cause.family`).
_AFTER_SUM = "rounding_order(order=the collective's, post=divide, divisor)"
_FAMILY = {"SUM, then divided by 2": _AFTER_SUM, "SUM, then divided by 3": _AFTER_SUM,
           "the result of step 0 (stale)": "stale(step)", "the result of step 1 (stale)": "stale(step)"}


def _failed(name: str, hook: str, *causes: str, fixes=None) -> CaseRecord:
    failure = {"header": "h", "findings": [], "message": "m", "rerun": None, "causes": list(causes),
               "families": {c: _FAMILY[c] for c in causes if c in _FAMILY}}
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
    assert cause_line(hook_causes(records, "h"), 3, hook_families(records, "h")) == (
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
    assert cause_line(causes, 14, hook_families(records, "h")) == (
        "most failures explained by: SUM, then divided by 2: 5 cases; SUM, then divided by 3: 3 cases (8 of 14 failed "
        "cases; 1 other cause(s) named)")
    assert cause_line([("the result of step 0 (stale)", 6)], 6) == (
        "most failures explained by: the result of step 0 (stale) (6 of 6 failed cases)")


def test_a_causes_family_is_its_code_and_parameters_never_its_words():
    """What makes two causes one family is the code and the parameters the rank side gave them, each number by its
    name: a failure records it (``failure.families``), and causes from a file before families are each their own."""
    by2 = Cause("rounding_order", (("order", "the collective's"), ("post", "divide"), ("divisor", 2)),
                "SUM, then divided by 2", "multiply by 1/2 first")
    by3 = Cause("rounding_order", (("order", "the collective's"), ("post", "divide"), ("divisor", 3)),
                "SUM, then divided by 3", "multiply by 1/3 first")
    assert by2.family == by3.family == _AFTER_SUM
    # A text that differs only in a number is no longer what joins them: another code is another family.
    other = Cause("wrong_divisor", (("divides_as", 2), ("group_size", 3)), "SUM, then divided by 2")
    assert other.family == "wrong_divisor(divides_as, group_size)" != by2.family
    found = [Finding(0, "m", kind="diagnosis", causes=(by3,)), Finding(1, "m", kind="diagnosis", causes=(by3,))]
    assert cause_fields(c for f in found for c in f.causes) == {
        "causes": ["SUM, then divided by 3"], "fixes": {"SUM, then divided by 3": "multiply by 1/3 first"},
        "families": {"SUM, then divided by 3": _AFTER_SUM}}
    old = [CaseRecord(id=f"t.py::{n}", name=n, outcome="failed", hook="h",
                      failure={"header": "h", "findings": [], "message": "m", "rerun": None, "causes": [c]})
           for n, c in (("a", "SUM, then divided by 2"), ("b", "SUM, then divided by 3"))]
    assert cause_line(hook_causes(old, "h"), 2, hook_families(old, "h")).endswith(
        "(1 of 2 failed cases; 1 other cause(s) named)")


def test_a_case_is_told_by_the_cause_its_findings_name_most_not_a_small_calls_first():
    """Issue 46's review: a 3-element call where several causes give the hook's bits named "divided by 3 before the
    SUM" first, beside the comm's own arithmetic, which the larger calls name alone. The record lists the cause
    the most findings name first, so the per-hook summary tells the comm's own story."""
    own = Cause("rounding_order", (("order", "rank"), ("post", "reciprocal"), ("divisor", 3)), "summed in rank order, "
                "then multiplied by 1/3", "reduce with dist.reduce_scatter_tensor itself")
    chance = Cause("rounding_order", (("order", "the collective's"), ("pre", "divide"), ("divisor", 3)),
                   "divided by 3 before the SUM", "divide nothing yourself")
    found = [Finding(r, "m", step=0, kind="diagnosis", causes=causes) for r in (0, 1, 2)
             for causes in ((chance, own), (own,))]
    fields = cause_fields(c for f in found for c in f.causes)
    assert fields["causes"] == ["summed in rank order, then multiplied by 1/3", "divided by 3 before the SUM"]
    record = CaseRecord(id="t.py::a", name="a", outcome="failed", hook="h",
                        failure={"header": "h", "findings": [], "message": "m", "rerun": None, **fields})
    assert cause_line(hook_causes([record], "h"), 1, hook_families([record], "h")).startswith(
        "most failures explained by: summed in rank order, then multiplied by 1/3 (1 of 1 failed cases")
