"""No hook can change another hook's verdict, and what a hook leaves behind fails its own case.

Runs the suite over ``tests/zoo/leaks.py``: hooks right in their arithmetic that leave their rank
process changed (a default dtype, a global module hook, a patched ``torch.distributed`` function from
the state factory, a destroyed default group, closed stdio, deterministic mode and thread counts), then
the hooks such leftovers used to harm in a shared pool (a float64 reducer that claims float32, a SUM
without averaging, DDP's own mean), then hooks that only count or print. The victims' outcomes must be
case for case those of a run of the victims alone; each leaker must fail with the change named; the
counting and printing hooks must conform; and no rank process may have run two hooks.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.meta_helpers import BackgroundJob, run_suite
from tests.zoo import leaks

#: Enough cases to show each leak and each victim's own failure: parity on the default config and
#: nested_wrapped, at 2 ranks and at 3 (where the float64 reducer is 1 ULP off).
SELECT = ["-k", "test_ddp_parity and default-nested_wrapped"]


def _mixed_run(runs, directory, env):
    """Leakers, victims and good hooks in one run; every rank writes its pid under ``pids/``."""
    pid_dir = os.path.join(directory, "pids")
    os.makedirs(pid_dir)
    run = run_suite(["--hook", "tests.zoo.leaks:LEAKERS", "--hook", "tests.zoo.leaks:VICTIMS",
                     "--hook", "tests.zoo.leaks:GOOD", *SELECT, "-q"], os.path.join(directory, "mixed.xml"),
                    timeout=600, env={**env, "CONFORM_TEST_PID_DIR": pid_dir})
    return run, pid_dir


def _victims_alone(runs, directory, env):
    return run_suite(["--hook", "tests.zoo.leaks:VICTIMS", *SELECT, "-q"], os.path.join(directory, "alone.xml"),
                     timeout=600, env=env)


#: Both runs, in the zoo runs' background threads (``tests/conftest.py``).
MIXED_RUN = BackgroundJob("leaks_mixed", _mixed_run)
VICTIMS_ALONE = BackgroundJob("leaks_victims_alone", _victims_alone)


@pytest.fixture(scope="module")
def mixed_run(zoo_runs):
    return zoo_runs(MIXED_RUN)[0]


@pytest.fixture(scope="module")
def pid_dir(zoo_runs):
    return zoo_runs(MIXED_RUN)[1]


@pytest.fixture(scope="module")
def victims_alone(zoo_runs):
    return zoo_runs(VICTIMS_ALONE)


@pytest.mark.parametrize("name", [spec.name for spec in leaks.LEAKERS])
def test_a_leaker_fails_its_own_cases_with_the_change_named(mixed_run, name):
    cases = mixed_run.by_hook()[name]
    assert cases and all(c.outcome == "failed" for c in cases), [(c.name, c.outcome) for c in cases]
    for case in cases:
        assert leaks.LEAK_NAMES[name] in case.message, case.message[-2000:]
        assert "declare what it promises" not in case.message, "a leak is no reason to declare a LossyContract"
    assert re.search(rf"^{name} +DOES NOT CONFORM \(left process state changed\)", mixed_run.output, re.MULTILINE)


def test_no_leaker_moves_a_victims_verdict(mixed_run, victims_alone):
    names = {spec.name for spec in leaks.VICTIMS}
    after = {c.name: c.outcome for c in mixed_run.cases if c.hook in names}
    alone = {c.name: c.outcome for c in victims_alone.cases}
    assert after and after == alone
    # The victims' own verdicts are real: the float64 reducer fails at 3 ranks, the SUM fails averaging,
    # and DDP's own mean conforms.
    assert after["test_ddp_parity[victim_float64-default-nested_wrapped-ws3]"] == "failed"
    assert after["test_ddp_parity[victim_sum-default-nested_wrapped-ws2]"] == "failed"
    assert {o for n, o in after.items() if "victim_mean" in n} == {"passed"}


def test_hooks_that_only_count_or_print_conform(mixed_run):
    for spec in leaks.GOOD:
        cases = mixed_run.by_hook()[spec.name]
        assert cases and {c.outcome for c in cases} == {"passed"}, [(c.name, c.message[-800:]) for c in cases]


def test_no_rank_process_ran_two_hooks(mixed_run, pid_dir):
    hooks_of = {}
    for entry in os.listdir(pid_dir):
        hook, pid = entry.rsplit(".", 1)
        hooks_of.setdefault(pid, set()).add(hook)
    assert len({h for hs in hooks_of.values() for h in hs}) >= 4, hooks_of
    assert all(len(hs) == 1 for hs in hooks_of.values()), hooks_of


def test_memory_grown_over_a_hooks_cases_fails_that_hook_alone(tmp_path):
    run = run_suite(["--hook", "tests.zoo.leaks:MEMORY", "--hook", "tests.zoo.leaks:GOOD", "--rank-memory-growth",
                     "128", "--extra-world-size", "0", "-k", "test_ddp_parity and ws2", "-q"], str(tmp_path / "m.xml"),
                    timeout=600)
    failed = [c for c in run.by_hook()["leak_memory"] if c.outcome == "failed"]
    assert failed and all("resident memory grew by" in c.message and "over this hook's" in c.message
                          for c in failed), run.output[-3000:]
    assert re.search(r"^leak_memory +DOES NOT CONFORM \(memory growth\)", run.output, re.MULTILINE)
    for spec in leaks.GOOD:
        assert {c.outcome for c in run.by_hook()[spec.name]} == {"passed"}


def test_a_pool_that_cannot_start_is_the_runs_error_not_the_hooks(tmp_path):
    import json

    from conformance.exit_codes import RUN_ERROR

    path = tmp_path / "results.json"
    run = run_suite(["--hook", "tests.zoo.unstartable:SPEC", "--hook", "tests.zoo.contained:GOOD",
                     "-k", "test_averaging", "--json", str(path), "-q"], str(tmp_path / "u.xml"), timeout=300)
    assert run.returncode == RUN_ERROR, run.output[-3000:]
    unstartable = run.by_hook()["zoo_unstartable"]
    assert unstartable and {c.outcome for c in unstartable} == {"skipped"}
    assert all(c.properties.get("not_run") for c in unstartable)
    assert re.search(r"^zoo_unstartable +NOT RUN \(its rank pool of world size 2 could not start: rank \d exited "
                     r"during start-up \(exit code 3\)", run.output, re.MULTILINE), run.output[-3000:]
    assert "DOES NOT CONFORM" not in run.output
    assert {c.outcome for c in run.by_hook()["zoo_plain_allreduce"]} == {"passed"}
    doc = json.loads(path.read_text())
    assert doc["run"]["exit_status"] == RUN_ERROR
    assert {h["name"]: h["status"] for h in doc["hooks"]} == {"zoo_unstartable": "not_run",
                                                              "zoo_plain_allreduce": "conforms"}
