"""The Markdown summary says why cases did not count: each known failure's and skip's reason, per hook, with
how many cases it covers; and the baseline diff lists a new failure once, not again as a changed figure."""

from __future__ import annotations

import json

from conformance.reports.baseline import diff_markdown, diff_runs
from conformance.reports.markdown_summary import markdown_summary
from conformance.reports.matrix import hook_matrix
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


def test_the_summary_says_what_ran_together_what_was_not_checked_and_which_code_ran():
    """Issue 44: per hook, the reach's combinations, a line per reason of what could not run here, and the hook code
    with each never-taken branch and its source; the document validates against the schema."""
    import jsonschema

    from conformance.reports import results
    from conformance.reports.hook_code import Branch, HookCode
    from conformance.reports.reach import Reach

    reach = Reach(cases=3, steps=256, buffer_bytes=29 * 2**20, world_sizes=(2, 3), nodes=(1, 2),
                  combinations=((256, 1024, 1), (2, 29 * 2**20, 1), (3, 1024, 2)), backends=("gloo",))
    branch = Branch("my/hooks.py", 88, 89, "if n >= 2**19:  # switch", "never true")
    code = HookCode(True, None, {"my/hooks.py": (9, 10, 3, 4)}, (branch,), (), ("my/hooks.py:hook",), 3)
    hook = {"name": "good", "api": "ddp", "reduce_dtype": "full", "lossy": None, "strategies": [], "description": "",
            "source": {"kind": "--hook", "target": "zoo:SPECS"}, "verdict": "CONFORMS", "status": "conforms",
            "counts": {"passed": 3, "skipped": 1}, "matrix": hook_matrix([], "good").to_json(),
            "reach": reach.to_json(), "hook_code": code.to_json(),
            "not_checked": [{"reason": "gloo has no ReduceOp.PREMUL_SUM (RuntimeError: ...): x",
                             "cases": ["fsdp2_parity[divide_factor]"]}]}
    doc = json.loads(json.dumps(document([case("good", "parity", "default", 2, "passed")], hooks=[hook])))
    jsonschema.validate(doc, results.schema())
    section = markdown_summary(doc).split("### Reach and hook code", 1)[1]
    assert "- reach: 256 steps on buffers up to 1 KiB; 2 steps on buffers up to 29 MiB; 3 steps on buffers up to " \
           "1 KiB on 2 simulated nodes; world sizes 2 and 3; gloo" in section
    assert "- not checked here: `fsdp2_parity[divide_factor]` (gloo has no ReduceOp.PREMUL_SUM)" in section
    assert "- hook code: 3 of 4 branches taken; never taken: hooks.py:88" in section
    assert "  - `never taken: my/hooks.py:88  if n >= 2**19:  # switch  (never true)`" in section


def test_an_interrupted_run_says_which_hooks_it_stopped_before_and_which_had_no_case_selected():
    """Issue 48: a hook whose cases the run never reached was listed as 'No case selected'."""
    doc = json.loads(json.dumps(document([case("ran", "parity", "default", 2, "passed")])))
    doc["run"]["interrupted"] = True
    doc["hooks"] += [{"name": "reached_never", "status": "interrupted", "counts": {}},
                     {"name": "deselected", "status": "not_run", "counts": {}}]
    lines = markdown_summary(doc).splitlines()
    assert "Not run (interrupted): `reached_never`: the run stopped before their cases." in lines
    assert "No case selected for: `deselected`." in lines
