"""Tests for the results files on synthetic case records, without a run.

The JSON document and its schema (conformance/reports/results.py, results.schema.json), the
atomic write, the report-path options (conformance/controller/settings.py), the baseline diff
(conformance/reports/baseline.py), the per-hook grid (conformance/reports/matrix.py) and the Markdown
summary (conformance/reports/markdown_summary.py). tests/test_results_run.py runs the suite.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from conformance.reports import results
from conformance.reports.baseline import BaselineDiff, diff_markdown, diff_runs, diff_text, options_changed
from conformance.reports.markdown_summary import markdown_summary
from conformance.reports.matrix import hook_matrix, matrix_markdown, matrix_text, pattern
from conformance.reports.results import CaseRecord, ResultsError
from conformance.reports.verdict import Status, Verdict
from conformance.controller.options import SettingsError
from conformance.shared.files import write_atomic
from tests.test_settings import settings

DDP_CONFIGS = ("default", "small_buckets", "bucket_view", "static_graph", "no_sync")


def case(hook, check, variant, ws, outcome, model="net", **kw) -> CaseRecord:
    name = f"test_{check}[{hook}-{variant}-{model}-ws{ws}]"
    return CaseRecord(id=f"test_ddp.py::{name}", name=name, outcome=outcome, duration_s=0.25, hook=hook, api="ddp",
                      check=check, variant=variant, variant_field="config", model=model, world_size=ws, **kw)


def overwritten_records():
    """A hook that fails parity in every config but bucket_view, at 2 and 3 ranks, and a good one."""
    out = []
    for ws in (2, 3):
        for config in DDP_CONFIGS:
            bad = config != "bucket_view"
            out.append(case("overwritten", "parity", config, ws, "failed" if bad else "passed",
                            figures={"max_ulp_diff": 1331840.0, "max_abs_diff": 0.27} if bad else {},
                            failure={"header": f"hook overwritten does not conform: check=parity config={config}",
                                     "findings": ["[rank 0, step 0, parameter 'w'] gradient differs"],
                                     "message": "...", "rerun": f"conform -k 'parity-{config}-ws{ws}'"}
                            if bad else None))
        out.append(case("good", "parity", "default", ws, "passed"))
    out.append(case("good", "hard_inputs", "default", 2, "xfailed", known_failure_reason="known failure (f#1): why"))
    out.append(case("good", "hard_inputs", "default", 3, "skipped", skip_reason="no 3 GPUs"))
    return out


def document(records, hooks=None, baseline=None):
    hooks = hooks if hooks is not None else [
        {"name": name, "api": "ddp", "reduce_dtype": "full", "lossy": None, "strategies": [], "description": "",
         "source": {"kind": "--hook", "target": "zoo:SPECS"}, "verdict": verdict.text,
         "status": verdict.status.value, "counts": {"passed": 1},
         "matrix": hook_matrix(records, name).to_json()}
        for name, verdict in (("overwritten", Verdict(Status.DOES_NOT_CONFORM, failed_checks=("parity",))),
                              ("good", Verdict(Status.KNOWN_FAILURES)))]
    return results.build_document(
        suite_version="0.1.0",
        run={"started_at": "2026-01-01T00:00:00+00:00", "finished_at": "2026-01-01T00:01:00+00:00",
             "duration_s": 60.0, "exit_status": 1, "interrupted": False, "fail_on": "failures", "args": []},
        environment={"torch_version": "2.13.0+cpu", "torch_build": "cpu", "backend": "gloo", "device": "cpu",
                     "world_sizes": [2, 3]},
        hooks=hooks, cases=records, baseline=baseline)


# -- the document and its schema ----------------------------------------------------------------


def test_document_validates_against_the_schema():
    jsonschema.validate(document(overwritten_records()), results.schema())


@pytest.mark.parametrize("breakage", ["outcome", "figure", "missing_field", "major_version"])
def test_schema_rejects_a_broken_document(breakage):
    doc = json.loads(json.dumps(document(overwritten_records())))
    if breakage == "outcome":
        doc["cases"][0]["outcome"] = "mostly passed"
    elif breakage == "figure":
        doc["cases"][0]["figures"]["max_ulp_diff"] = "a lot"
    elif breakage == "missing_field":
        del doc["cases"][0]["world_size"]
    else:
        doc["schema_version"] = "2.0"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, results.schema())


def test_infinite_figures_travel_as_strings_in_strict_json(tmp_path):
    rec = case("h", "hard_inputs", "default", 2, "failed", figures={"max_ulp_diff": float("inf"), "max_abs_diff": 3.5})
    path = tmp_path / "r.json"
    results.write_json(str(path), document([rec], hooks=[]))
    text = path.read_text()
    assert "Infinity" not in text
    loaded = results.load_results(str(path))
    assert loaded["cases"][0]["figures"] == {"max_ulp_diff": "inf", "max_abs_diff": 3.5}
    assert results.records_from_json(loaded)[0].figures == {"max_ulp_diff": float("inf"), "max_abs_diff": 3.5}


def test_a_case_record_survives_the_json_round_trip():
    recs = overwritten_records()
    back = results.records_from_json(json.loads(json.dumps(document(recs))))
    assert back == recs


# -- the atomic write ---------------------------------------------------------------------------


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "conformance.json"
    path.write_text("old")
    write_atomic(str(path), "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["conformance.json"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600), "mkstemp's 0o600 leaked into the report"


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, monkeypatch, interruption):
    path = tmp_path / "conformance.json"
    path.write_text('{"old": true}')

    def interrupted(fd):
        raise interruption("stopped while writing")

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(interruption):
        write_atomic(str(path), '{"new": true, "long": "' + "x" * 100000 + '"}')
    assert path.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["conformance.json"]


def test_write_json_refuses_nan_outside_figures(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(ValueError):
        results.write_json(str(path), {"schema_version": results.SCHEMA_VERSION, "x": float("nan")})
    assert not path.exists()


# -- report paths and options, checked before any case ------------------------------------------


def test_unwritable_reason_for_a_directory_and_a_path_under_a_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "is a directory" in results.unwritable_reason(str(tmp_path))
    assert "cannot write in" in results.unwritable_reason(str(blocker / "reports" / "r.json"))
    assert results.unwritable_reason(str(tmp_path / "new" / "dir" / "r.json")) is None
    assert (tmp_path / "new" / "dir").is_dir() and not (tmp_path / "new" / "dir" / "r.json").exists()


def test_report_options_resolve_from_the_command_line_then_the_environment(tmp_path):
    cli = settings({"conform_json": str(tmp_path / "cli.json")}, {"CONFORM_JSON": str(tmp_path / "env.json")})
    env = settings({}, {"CONFORM_JSON": str(tmp_path / "env.json"), "CONFORM_MARKDOWN": str(tmp_path / "s.md")})
    assert cli.json_path == str(tmp_path / "cli.json")
    assert (env.json_path, env.markdown_path) == (str(tmp_path / "env.json"), str(tmp_path / "s.md"))
    assert settings().json_path is None and settings().fail_on == "failures"


def test_an_unwritable_report_path_is_a_usage_error_naming_its_source(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SettingsError, match=r"from CONFORM_MARKDOWN: cannot write in"):
        settings({}, {"CONFORM_MARKDOWN": str(blocker / "summary.md")})
    with pytest.raises(SettingsError, match=r"from --json: .* is a directory"):
        settings({"conform_json": str(tmp_path)})


def test_fail_on_regressions_needs_a_baseline_that_is_a_file(tmp_path):
    with pytest.raises(SettingsError, match="needs a baseline"):
        settings({"conform_fail_on": "regressions"})
    with pytest.raises(SettingsError, match=r"baseline .* from CONFORM_BASELINE is not a file"):
        settings({"conform_fail_on": "regressions"}, {"CONFORM_BASELINE": str(tmp_path / "missing.json")})
    with pytest.raises(SettingsError, match="expected failures, regressions or uncovered"):
        settings({"conform_fail_on": "new"})
    base = tmp_path / "base.json"
    base.write_text("{}")
    s = settings({"conform_fail_on": "regressions", "conform_baseline": str(base)})
    assert (s.fail_on, s.baseline_path) == ("regressions", str(base))


def test_load_results_refuses_other_files_with_the_reason(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{not json")
    with pytest.raises(ResultsError, match="not valid JSON"):
        results.load_results(str(path))
    path.write_text('{"testsuites": []}')
    with pytest.raises(ResultsError, match="not a conformance results file"):
        results.load_results(str(path))
    path.write_text('{"schema_version": "2.0", "cases": []}')
    with pytest.raises(ResultsError, match="schema_version 2.0"):
        results.load_results(str(path))


def test_load_results_refuses_a_document_whose_entries_lack_fields_naming_the_first_bad_entry(tmp_path):
    """The header is right, so only the schema sees it; unchecked, the diff ended in a TypeError traceback."""
    doc = json.loads(json.dumps(document(overwritten_records())))
    del doc["cases"][3]["outcome"], doc["cases"][3]["world_size"]
    doc["cases"][5]["duration_s"] = "slow"
    del doc["cases"][7]["id"]
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsError) as raised:
        results.load_results(str(path))
    assert str(raised.value) == (
        f"results file {path} does not match the results schema (results.schema.json): cases[3] "
        f"(id {doc['cases'][3]['id']!r}) lacks the fields 'outcome', 'world_size' (and 2 more problems). Give a "
        "file written by --json, unedited, or run once without --baseline to write a new one")
    assert results.schema_problems(doc)[1:] == [
        f"cases[5] (id {doc['cases'][5]['id']!r}), field 'duration_s': 'slow' is not of type 'number'",
        f"cases[7] (name {doc['cases'][7]['name']!r}) lacks the field 'id'"]


def test_schema_problems_name_a_top_level_field_and_a_nested_one():
    doc = json.loads(json.dumps(document(overwritten_records())))
    del doc["run"]["args"]
    doc["hooks"][1]["status"] = "fine"
    assert results.schema_problems(doc) == [
        "hooks[1] (name 'good'), field 'status': 'fine' is not one of ['conforms', 'known_failures', "
        "'does_not_conform', 'not_checked_across_ranks', 'not_run', 'interrupted', 'running', 'other']",
        "run lacks the field 'args'"]
    assert results.schema_problems(document(overwritten_records())) == []


# -- the baseline diff ----------------------------------------------------------------------------


def test_baseline_diff_sorts_every_change_into_its_category():
    before = [case("h", "parity", "default", 2, "passed"),                       # -> failed: new failure
              case("h", "parity", "no_sync", 2, "failed", figures={"max_ulp_diff": 3.0}),  # -> passed: fixed
              case("h", "parity", "static_graph", 2, "failed", figures={"max_ulp_diff": 3.0}),  # figure moves
              case("h", "averaging", "default", 2, "passed"),                    # disappears
              case("h", "hard_inputs", "default", 2, "passed")]                  # -> skipped: other change
    now = [case("h", "parity", "default", 2, "failed", figures={"max_ulp_diff": 1.0}),
           case("h", "parity", "no_sync", 2, "passed"),
           case("h", "parity", "static_graph", 2, "failed", figures={"max_ulp_diff": 5.0}),
           case("h", "hard_inputs", "default", 2, "skipped"),
           case("h", "parity", "bucket_view", 2, "passed"),                      # appears, passing
           case("h", "rank_consistency", "default", 2, "error")]                 # appears, failing
    diff = diff_runs(document(before, hooks=[]), now, "base.json")
    ids = lambda changes: sorted(c.id.split("[")[1].rstrip("]") for c in changes)  # noqa: E731
    assert ids(diff.new_failures) == ["h-default-net-ws2", "h-default-net-ws2"]
    assert {c.id.split("::")[1].split("[")[0] for c in diff.new_failures} == {"test_parity", "test_rank_consistency"}
    assert [(c.before, c.after) for c in diff.fixed] == [("failed", "passed")]
    assert ids(diff.appeared) == ["h-bucket_view-net-ws2", "h-default-net-ws2"]
    assert [c.before for c in diff.disappeared] == ["passed"] and "test_averaging" in diff.disappeared[0].id
    assert [(c.before, c.after) for c in diff.changed_outcomes] == [("passed", "skipped")]
    figs = {(f.id.split("[")[1], f.before, f.after) for f in diff.changed_figures}
    # A new failure's figures are its own, not a change: listed once, as a new failure.
    assert figs == {("h-static_graph-net-ws2]", 3.0, 5.0), ("h-no_sync-net-ws2]", 3.0, None)}
    assert diff.regressions == diff.new_failures
    lines = diff_text(diff)
    assert lines[0].startswith("against base.json (run started 2026-01-01T00:00:00+00:00): 2 new failures, 1 fixed")
    assert BaselineDiff.from_json(json.loads(json.dumps(diff.to_json()))) == diff


def test_a_run_identical_to_its_baseline_has_an_empty_diff():
    recs = overwritten_records()
    diff = diff_runs(json.loads(json.dumps(document(recs))), recs)
    assert diff.empty() and not diff.regressions


def test_a_baseline_run_with_other_options_is_said_to_differ_in_them():
    """Issue 31: a --depth nightly baseline against a default run listed 19 'disappeared' cases and never said the
    runs were asked for different cases."""
    baseline = document(overwritten_records())
    baseline["environment"].update(depth="nightly", hypothesis_examples=200)
    baseline["run"]["args"] = ["-c", "pytest.ini", "-k", "parity", "--depth", "nightly"]
    now_env = {**baseline["environment"], "depth": "default", "hypothesis_examples": 3, "world_sizes": [2, 3, 4]}
    changed = options_changed(baseline, now_env, ["overwritten", "mine"], ["-c", "pytest.ini", "-kaveraging"])
    assert changed == ["depth nightly -> default", "world_sizes 2,3 -> 2,3,4", "hypothesis_examples 200 -> 3",
                       "hooks: +mine, -good", "-k 'parity' -> 'averaging'"]
    same = options_changed(baseline, dict(baseline["environment"]), ["overwritten", "good"], baseline["run"]["args"])
    assert same == []
    older = dict(baseline["environment"])
    del older["depth"]  # a file of schema 1.4 has no depth: nothing is said of it
    assert options_changed({**baseline, "environment": older}, now_env, ["overwritten", "good"],
                           baseline["run"]["args"]) == ["world_sizes 2,3 -> 2,3,4", "hypothesis_examples 200 -> 3"]
    diff = diff_runs(baseline, overwritten_records(), "nightly.json")
    diff.options_changed = changed
    said = "the two runs' options differ, so cases may have appeared or disappeared for that, not for a hook: "
    assert diff_text(diff)[1] == said + "; ".join(changed)
    assert ("T" + said[1:] + "; ".join(changed) + ".") in diff_markdown(diff)
    doc = document(overwritten_records(), baseline=diff.to_json())
    assert results.schema_problems(doc) == []
    assert BaselineDiff.from_json(doc["baseline"]).options_changed == changed


def test_a_known_failure_that_fails_is_not_a_regression():
    before = [case("h", "parity", "default", 2, "failed")]
    now = [case("h", "parity", "default", 2, "xfailed")]
    diff = diff_runs(document(before, hooks=[]), now)
    assert not diff.regressions and not diff.fixed
    assert [(c.before, c.after) for c in diff.changed_outcomes] == [("failed", "xfailed")]


# -- the per-hook grid ----------------------------------------------------------------------------


def test_matrix_shows_failing_everywhere_except_bucket_view():
    m = hook_matrix(overwritten_records(), "overwritten")
    assert m.variants == DDP_CONFIGS and m.world_sizes == (2, 3) and m.checks == ("parity",)
    assert {v: m.cells[("parity", v, 2)].outcome for v in DDP_CONFIGS} == {
        "default": "fail", "small_buckets": "fail", "bucket_view": "pass", "static_graph": "fail", "no_sync": "fail"}
    assert pattern(m) == "fails in every config except bucket_view, at world sizes 2 and 3"
    lines = matrix_text(m)
    header = lines[1].split()
    assert header == ["check", "ws", *DDP_CONFIGS]
    assert lines[2].split() == ["parity", "2", "FAIL", "FAIL", "pass", "FAIL", "FAIL"]
    assert "| parity | 3 | **FAIL** | **FAIL** | pass | **FAIL** | **FAIL** |" in matrix_markdown(m)


def test_matrix_cell_takes_the_worst_case_and_counts_failures():
    recs = [case("h", "parity", "default", 2, "passed", model="a"), case("h", "parity", "default", 2, "failed", model="b"),
            case("h", "parity", "default", 2, "passed", model="c"),
            case("h", "hard_inputs", "default", 2, "xfailed"), case("h", "hard_inputs", "default", 2, "passed", model="b"),
            case("h", "averaging", "default", 3, "skipped")]
    m = hook_matrix(recs, "h")
    assert m.cells[("parity", "default", 2)].text() == "FAIL 1/3"
    assert m.cells[("hard_inputs", "default", 2)].outcome == "xfail"
    assert m.cells[("averaging", "default", 3)].outcome == "skip"
    assert pattern(m) == "fails in config default"
    assert ("averaging", 2) not in m.rows() and ("averaging", 3) in m.rows()


def test_matrix_pattern_names_the_world_size_a_rounding_bug_shows_at():
    recs = [case("h", "parity", v, ws, "failed" if ws == 3 and v == "default" else "passed")
            for v in ("default", "small_buckets", "no_sync") for ws in (2, 3)]
    assert pattern(hook_matrix(recs, "h")) == "fails only in config default, only at world size 3"


def test_a_hook_with_no_failure_has_no_pattern():
    assert pattern(hook_matrix([case("h", "parity", "default", 2, "passed")], "h")) == ""


# -- the Markdown summary ------------------------------------------------------------------------


def test_markdown_has_the_verdicts_the_grid_the_findings_and_the_rerun_commands():
    recs = overwritten_records()
    before = [r for r in recs if r.variant != "default"]
    doc = document(recs, baseline=diff_runs(document(before, hooks=[]), recs, "nightly.json").to_json())
    text = markdown_summary(json.loads(json.dumps(doc)))
    assert "| `overwritten` | ddp | full-precision averaging | **DOES NOT CONFORM (parity)** | 1 passed |" in text
    assert "| `good` | ddp | full-precision averaging | known failures | 1 passed |" in text
    assert "Pattern: fails in every config except bucket_view, at world sizes 2 and 3." in text
    assert "hook overwritten does not conform: check=parity config=default" in text
    assert "conform -k 'parity-default-ws2'" in text
    assert "First findings (3 of 8 failed cases)" in text
    assert "Against `nightly.json`: 2 new failures, 0 fixed, 6 appeared" in text


def test_failure_figures_take_the_largest_value_mismatch_and_ignore_others():
    import torch

    from conformance.shared.compare import compare_bitwise
    from conformance.protocol import Finding
    from conformance.reports.bookkeeper import failure_figures

    one_ulp = compare_bitwise(torch.tensor([1.0]).nextafter(torch.tensor([2.0])), torch.tensor([1.0]))
    big = compare_bitwise(torch.tensor([1.5, 1.0]), torch.tensor([1.0, 1.0]))
    dtype = compare_bitwise(torch.tensor([1.0], dtype=torch.float16), torch.tensor([1.0]))
    found = [Finding(0, "x", mismatch=one_ulp), Finding(1, "y", mismatch=big), Finding(1, "z", mismatch=dtype),
             Finding(0, "no tensor")]
    assert failure_figures(found) == {"max_ulp_diff": big.max_ulp_diff, "max_abs_diff": 0.5}
    assert big.max_ulp_diff > one_ulp.max_ulp_diff == 1
    assert failure_figures(found[2:]) == {}


def _code(*branches, measured=True):
    return {"measured": measured, "never_taken": [{"file": f, "line": line, "to": None, "source": src, "how": how}
                                                  for f, line, src, how in branches]}


def test_the_baseline_remembers_never_taken_branches_and_a_new_one_is_a_regression():
    """Issue 44: a branch of a hook's code the baseline's cases took, and this run's did not, fails --fail-on
    regressions; one that moved to another line (code edited above it) is the same branch."""
    from conformance.reports.baseline import BaselineDiff, diff_text, new_never_taken

    switch = ("h.py", 88, "if n >= 2**19:  # switch", "never true")
    baseline = {"hooks": [{"name": "a", "hook_code": _code(switch)}, {"name": "b", "hook_code": _code()},
                          {"name": "c", "hook_code": _code(measured=False)}]}
    moved = ("h.py", 90, "if n >= 2**19:  # switch", "never true")
    now = {"a": _code(moved), "b": _code(("g.py", 7, "if warm:", "never false")), "c": _code(switch),
           "d": _code(switch)}
    (change,) = new_never_taken(baseline, now)
    assert (change.hook, change.where, change.how) == ("b", "g.py:7", "never false")
    diff = BaselineDiff(baseline="x", new_never_taken=[change])
    assert diff.regressions == [change] and not diff.empty()
    assert BaselineDiff.from_json(diff.to_json()) == diff
    assert "newly never-taken branches:" in "\n".join(diff_text(diff))


def test_write_atomic_makes_a_reproducer_executable(tmp_path):
    path = tmp_path / "case.py"
    assert write_atomic(str(path), "print(1)\n", executable=True) == str(path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    assert os.listdir(tmp_path) == ["case.py"]
