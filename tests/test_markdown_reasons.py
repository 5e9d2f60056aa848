"""The Markdown summary says why cases did not count: each known failure's and skip's reason, per hook, with
how many cases it covers; and the baseline diff lists a new failure once, not again as a changed figure."""

from __future__ import annotations

import json

from conformance.reports.baseline import diff_markdown, diff_runs
from conformance.reports.markdown_summary import markdown_summary
from tests.test_results import case, document


def test_markdown_lists_the_known_failure_and_skip_reasons_by_hook_with_counts():
    recs = [case("good", "parity", "default", 2, "passed"),
            case("good", "hard_inputs", "default", 2, "xfailed", known_failure_reason="known failure (f#1): why | so"),
            case("good", "hard_inputs", "bucket_view", 2, "xfailed",
                 known_failure_reason="known failure (f#1): why | so"),
            case("good", "hard_inputs", "default", 3, "skipped", skip_reason="no 3 GPUs\nhere"),
            case("overwritten", "parity", "default", 2, "xpassed", known_failure_reason="known failure (f#2): gone")]
    text = markdown_summary(json.loads(json.dumps(document(recs))))
    section = text.split("### Known failures and skips", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == ["| `overwritten` | 1 | known failure, now passes | known failure (f#2): gone |",
                    "| `good` | 2 | known failure | known failure (f#1): why \\| so |",
                    "| `good` | 1 | skipped | no 3 GPUs here |"]


def test_a_run_without_known_failures_or_skips_has_no_such_section():
    text = markdown_summary(json.loads(json.dumps(document([case("good", "parity", "default", 2, "passed")]))))
    assert "Known failures and skips" not in text


def test_the_baseline_diff_lists_each_new_failure_once():
    """The issue's Markdown repeated 9 new failures as 9 more 'none -> X' changed figures."""
    before = [case("h", "parity", v, 2, "passed") for v in ("default", "no_sync")]
    now = [case("h", "parity", v, 2, "failed", figures={"max_ulp_diff": 2.0, "max_abs_diff": 1e-7})
           for v in ("default", "no_sync")]
    diff = diff_runs(document(before, hooks=[]), now, "base.json")
    assert len(diff.new_failures) == 2 and diff.changed_figures == []
    text = diff_markdown(diff)
    assert "2 new failures" in text and "0 changed figures" in text and "none ->" not in text


def test_the_environment_line_names_every_world_size_of_the_run():
    doc = json.loads(json.dumps(document([case("good", "parity", "default", 2, "passed")])))
    doc["environment"]["world_sizes"] = [2, 3, 4]
    assert " · world sizes 2, 3 and 4 · " in markdown_summary(doc)
