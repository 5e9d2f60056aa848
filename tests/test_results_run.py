"""Meta-tests of the results files: the suite run as a user runs it, with --json, --markdown, --baseline.

One run over a DDP hook that is right only with ``gradient_as_bucket_view``
(``bad_averages_param_grads`` in ``tests/zoo/ddp_hooks/``) and a known-good hook: the JSON validates
against the schema, agrees with the JUnit XML case by case, and its grid, the
terminal's and the Markdown's show the pattern "fails in every config except
bucket_view". Then a nightly round trip: a hook that changes between runs under
one name, diffed against the previous run's JSON, with ``--fail-on regressions``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import textwrap

import jsonschema
import pytest

from conformance.reports import results
from tests.meta_helpers import BackgroundJob, run_suite

BAD = "bad_averages_param_grads"
GOOD = "good_mean_allreduce"
OLD_STEP_SUMMARY = "## an earlier step's summary\n"


def _overwritten_run(runs, directory, env):
    paths = {name: os.path.join(directory, name) for name in ("zoo.xml", "zoo.json", "zoo.md", "step_summary.md")}
    with open(paths["step_summary.md"], "w") as f:
        f.write(OLD_STEP_SUMMARY)
    run = run_suite(["--hook", "tests.zoo.ddp_hooks:ALL",
                     "-q", "-k", f"({BAD} or ({GOOD}- and test_ddp_parity)) and not batched_grad_copy",
                     "--json", paths["zoo.json"], "--markdown", paths["zoo.md"]], paths["zoo.xml"],
                    env={**env, "GITHUB_STEP_SUMMARY": paths["step_summary.md"]})
    return run, paths


#: The run, in the zoo runs' background threads (``tests/conftest.py``).
OVERWRITTEN_RUN = BackgroundJob("results_run", _overwritten_run)


@pytest.fixture(scope="module")
def overwritten_run(zoo_runs):
    run, paths = zoo_runs(OVERWRITTEN_RUN)
    assert run.cases, f"the suite wrote no JUnit cases; output:\n{run.output[-4000:]}"
    with open(paths["zoo.json"]) as f:
        doc = json.load(f)
    return run, doc, paths


def test_json_validates_against_the_schema(overwritten_run):
    _, doc, _ = overwritten_run
    jsonschema.validate(doc, results.schema())
    assert doc["schema_version"] == results.SCHEMA_VERSION
    assert (doc["run"]["complete"], doc["run"]["interrupted"], doc["run"]["exit_status"]) == (True, False, 1)


def test_json_agrees_with_junit_case_by_case(overwritten_run):
    run, doc, _ = overwritten_run
    junit = {c.name: c for c in run.cases}
    cases = {c["name"]: c for c in doc["cases"]}
    assert set(cases) == set(junit)
    for name, case in cases.items():
        j = junit[name]
        assert case["outcome"] == j.outcome, name
        for prop in ("hook", "api", "check", "variant", "model"):
            assert case[prop] == j.properties.get(prop), (name, prop)
        assert case["world_size"] == int(j.properties["world_size"])
        for figure, value in case["figures"].items():  # the float as measured; JUnit has its text
            shown = results.ShortFigure if figure in ("observed_rel_error", "observed_loss_rel_diff") else results.Figure
            assert j.properties[figure] == str(shown(results.parse_figure(value))), (name, figure)


def test_failed_cases_carry_their_figures_findings_and_rerun_command(overwritten_run):
    _, doc, _ = overwritten_run
    failed = [c for c in doc["cases"] if c["outcome"] == "failed"]
    assert failed and all(c["hook"] == BAD for c in failed)
    parity = [c for c in failed if c["check"] == "parity"]
    assert parity and all(results.parse_figure(c["figures"]["max_ulp_diff"]) > 0 for c in parity)
    for c in failed:
        assert c["failure"]["header"].startswith(f"hook {BAD} does not conform: check={c['check']}")
        assert c["failure"]["findings"], c["name"]
        assert c["failure"]["rerun"].endswith(f"-k '{c['name']}'")
    assert all(c["failure"] is None and not c["figures"] for c in doc["cases"] if c["outcome"] == "passed")


def test_environment_and_hooks_are_recorded(overwritten_run):
    _, doc, _ = overwritten_run
    import torch

    env = doc["environment"]
    assert env["torch_version"] == torch.__version__
    assert env["torch_build"] == ("cuda" if torch.version.cuda else "cpu") and env["backend"] == "gloo"
    assert env["world_sizes"] == [2, 3, 4]  # 2 and 3, and 4 for the ddp parity cases of the subgroup config
    hooks = {h["name"]: h for h in doc["hooks"]}
    assert hooks[BAD]["source"] == {"kind": "--hook", "target": "tests.zoo.ddp_hooks:ALL"}
    assert hooks[BAD]["status"] == "does_not_conform" and hooks[BAD]["verdict"].startswith("DOES NOT CONFORM (")
    assert hooks[GOOD]["status"] == "conforms" and hooks[GOOD]["counts"] == {
        "passed": sum(c["hook"] == GOOD for c in doc["cases"])}
    assert hooks["good_fp16_claim"]["reduce_dtype"] == "float16" and hooks["good_fp16_claim"]["counts"] == {}
    assert hooks["good_fp16_lossy_declared"]["lossy"]["rel_error_bound"] == pytest.approx(1e-2)


def _configs(run, hook, outcome):
    return {c.properties["variant"] for c in run.cases if c.hook == hook and c.outcome == outcome}


def test_the_grid_shows_failing_everywhere_except_bucket_view(overwritten_run):
    run, doc, paths = overwritten_run
    # The pattern, from the JUnit XML alone: bucket_view is the one config without a failure.
    failing, passing = _configs(run, BAD, "failed"), _configs(run, BAD, "passed")
    assert passing - failing == {"bucket_view"} and len(failing) >= 5, (failing, passing)
    matrix = next(h["matrix"] for h in doc["hooks"] if h["name"] == BAD)
    assert matrix["pattern"].startswith("fails in every config except bucket_view")
    parity_ws2 = {c["variant"]: c["outcome"] for c in matrix["cells"] if c["check"] == "parity" and c["world_size"] == 2}
    assert parity_ws2["bucket_view"] == "pass"
    assert {v for v, o in parity_ws2.items() if o == "fail"} == set(parity_ws2) - {"bucket_view"}
    # The terminal prints the same grid under the hook's verdict line, and none for a conforming hook.
    lines = run.output.splitlines()
    verdict_at = next(i for i, line in enumerate(lines) if re.match(rf"{BAD} +DOES NOT CONFORM", line))
    # the pattern follows the verdict line (and the line that says the -k selected only some of its cases)
    pattern_at = next(i for i in (verdict_at + 1, verdict_at + 2)
                      if "fails in every config except bucket_view" in lines[i])
    header = lines[pattern_at + 1].split()
    assert header[:2] == ["check", "ws"] and set(header[2:]) == set(matrix["variants"])
    parity_row = next(line.split() for line in lines[pattern_at + 2:] if line.split()[:2] == ["parity", "2"])
    assert [parity_row[2 + i] for i, v in enumerate(header[2:]) if v == "bucket_view"] == ["pass"]
    good_at = next(i for i, line in enumerate(lines) if line.startswith(f"{GOOD} "))
    assert "CONFORMS" in lines[good_at] and lines[good_at + 1].split()[:2] != ["check", "ws"]


def test_markdown_file_and_github_step_summary(overwritten_run):
    _, doc, paths = overwritten_run
    with open(paths["zoo.md"]) as f:
        markdown = f.read()
    assert f"| `{BAD}` | ddp | full-precision averaging | **DOES NOT CONFORM (" in markdown
    assert f"| `{GOOD}` | ddp | full-precision averaging | CONFORMS |" in markdown
    assert "Pattern: fails in every config except bucket_view" in markdown
    first = next(c for c in doc["cases"] if c["outcome"] == "failed")
    assert first["failure"]["header"] in markdown and first["failure"]["rerun"] in markdown
    with open(paths["step_summary.md"]) as f:
        step = f.read()
    assert step.startswith(OLD_STEP_SUMMARY) and markdown in step


# -- the nightly round trip: one hook name, changed between runs -----------------------------------

NIGHTLY_HOOK = '''
import torch.distributed as dist
from conformance import HookSpec


def nightly(process_group, bucket):
    tensor = bucket.buffer()
    if {average}:  # DDP's own averaging: multiply by 1/world_size, then SUM
        tensor.mul_(1.0 / process_group.size())
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


SPEC = HookSpec(name="nightly_hook", api="ddp", hook=nightly, state=lambda pg: pg)
'''


def _nightly(tmp_path, name, average):
    """A directory whose ``nightly_hook`` module holds a right (averaging) or wrong (SUM only) hook."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "nightly_hook.py").write_text(textwrap.dedent(NIGHTLY_HOOK.format(average=average)))
    return str(directory)


def _ids(changes):
    return sorted(c["id"] for c in changes)


def _round_trip(runs, directory, env):
    """Runs A (the hook averages), B (the same hook name sums, against A) and C (still wrong, against B), each
    with its JSON results: ``(run_a, run_b, run_c, (a, b, c))``."""
    tmp_path = pathlib.Path(directory)
    good, bad = _nightly(tmp_path, "good", True), _nightly(tmp_path, "bad", False)
    a, b, c = (str(tmp_path / f"{n}.json") for n in "abc")
    common = ["--hook", "nightly_hook:SPEC", "-q", "--extra-world-size", "0"]  # one pool of 2 ranks: fast
    run_a = run_suite([*common, "-k", "test_ddp_averaging", "--json", a], str(tmp_path / "a.xml"), cwd=good,
                      env=env)
    run_b = run_suite([*common, "-k", "test_ddp_averaging or test_ddp_rank_consistency", "--json", b,
                       "--baseline", a, "--fail-on", "regressions"], str(tmp_path / "b.xml"), cwd=bad, env=env)
    run_c = run_suite([*common, "-k", "test_ddp_averaging", "--json", c, "--baseline", b, "--fail-on", "regressions"],
                      str(tmp_path / "c.xml"), cwd=bad, env=env)
    return run_a, run_b, run_c, (a, b, c)


#: The three runs, in the zoo runs' background threads (``tests/conftest.py``).
ROUND_TRIP = BackgroundJob("baseline_round_trip", _round_trip)


def test_baseline_round_trip_lists_the_changes_and_gates_on_regressions_only(zoo_runs):
    run_a, run_b, run_c, (a, b, c) = zoo_runs(ROUND_TRIP)

    # Run A: the hook averages; the averaging cases pass.
    assert run_a.returncode == 0, run_a.output[-3000:]
    averaging = _ids(x for x in json.load(open(a))["cases"] if x["outcome"] == "passed")
    assert len(averaging) == 1

    # Run B: the same hook name now sums without averaging, and rank consistency joins the run.
    assert run_b.returncode == 1, run_b.output[-3000:]
    diff = json.load(open(b))["baseline"]
    rank_consistency = _ids(x for x in json.load(open(b))["cases"] if x["check"] == "rank_consistency")
    # Every rank holds the same sum, so rank consistency passes: it appeared, and is no new failure.
    assert rank_consistency and _ids(diff["appeared"]) == rank_consistency
    assert {x["after"] for x in diff["appeared"]} == {"passed"}
    assert _ids(diff["new_failures"]) == averaging
    assert {(x["before"], x["after"]) for x in diff["new_failures"] if x["id"] in averaging} == {("passed", "failed")}
    assert not {x["id"] for x in diff["changed_figures"]} & set(averaging)  # a new failure is listed once
    assert diff["fixed"] == diff["disappeared"] == []
    assert "against the baseline" in run_b.output and "--fail-on regressions: exit status 1" in run_b.output
    jsonschema.validate(json.load(open(b)), results.schema())

    # Run C: still wrong, but nothing new against B: with --fail-on regressions the run exits 0.
    assert {x.outcome for x in run_c.cases} == {"failed"}
    assert run_c.returncode == 0, run_c.output[-3000:]
    diff = json.load(open(c))["baseline"]
    assert diff["new_failures"] == [] and _ids(diff["disappeared"]) == rank_consistency
    assert "--fail-on regressions: exit status 0, no new failure against the baseline" in run_c.output
    # C selected fewer cases than B: the diff says so, which explains what disappeared.
    assert diff["options_changed"] == ["-k 'test_ddp_averaging or test_ddp_rank_consistency' -> 'test_ddp_averaging'"]
    assert "the two runs' options differ" in run_c.output


def test_the_projects_own_tests_leave_the_github_step_summary_alone(tmp_path):
    """conftest.py loads the plugin for tests/ too; a run without conformance cases writes no summary."""
    import subprocess
    import sys

    summary = tmp_path / "step_summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "tests/test_cases.py"],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert not summary.exists()
