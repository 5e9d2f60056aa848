"""A hook that hangs or kills a rank is contained: that case fails, the run goes on.

Runs the suite (as a user would) over ``tests/zoo/contained.py``: a hook that
hangs on rank 1, one that exits rank 1 mid-backward, one that aborts rank 1
once in the run, two that end rank 1's process once in the run with an exit
status of their own (``sys.exit(3)``, ``os._exit(3)``), and PyTorch's plain
``allreduce_hook`` after them. The first two must fail with what each rank was
doing, the pool must be rebuilt, the abort (a death by a signal) must pass (its
case runs once more in fresh ranks, where nothing kills a rank) with the first
run's death in the summary, the two own exits must fail at once (the hook's
doing, never re-run), and the last must still pass, with the JUnit report written.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from conformance.reports import results
from tests.meta_helpers import BackgroundJob, run_suite


def _contained_run(runs, directory, env):
    env = {**env, "CONFORM_TEST_CRASH_ONCE": os.path.join(directory, "aborted-once"),
           "CONFORM_TEST_EXIT_ONCE": os.path.join(directory, "exited-once")}
    return run_suite(["--hook", "tests.zoo.contained:ALL", "--case-timeout", "5", "--extra-world-size", "0",
                      "-k", "test_averaging", "-q", f"--json={os.path.join(directory, 'contained.json')}"],
                     os.path.join(directory, "contained.xml"), timeout=300, env=env)


#: The run, in the zoo runs' background threads (``tests/conftest.py``).
CONTAINED_RUN = BackgroundJob("contained", _contained_run)


#: The raising case as a known failure: a failure there is not replayed with PyTorch's default hook (whose ranks
#: of its own would replace the hook's), so the next case gets the same ranks unless the suite rebuilds them, as
#: after a reference that PyTorch cannot run (replayed on the same ranks, then skipped).
MID_WAY_KNOWN = """
[[failure]]
hook = "zoo_raise_mid_way"
test = "test_parity[zoo_raise_mid_way-NO_SHARD-net_wrapped-ws2]"
reason = "raises at its first call, on purpose"
"""


def _mid_way_run(runs, directory, env):
    env = {**env, "CONFORM_TEST_RAISE_ONCE": os.path.join(directory, "raised-once")}
    known = os.path.join(directory, "mid_way_known.toml")
    with open(known, "w") as f:
        f.write(MID_WAY_KNOWN)
    return run_suite(["--hook", "tests.zoo.contained:GROUPS", "--case-timeout", "10", "--extra-world-size",
                      "0", "-k", "test_parity and (net_wrapped or net_flat) and not 2nodes", "-q", "-p", "no:randomly",
                      "--known-failures", known], os.path.join(directory, "mid_way.xml"), timeout=300, env=env)


MID_WAY_RUN = BackgroundJob("raise_mid_way", _mid_way_run)


@pytest.fixture(scope="module")
def contained_run(zoo_runs):
    return zoo_runs(CONTAINED_RUN)


def _case(run, hook):
    return next(c for c in run.cases if c.hook == hook)


def test_run_finishes_with_a_report_and_exit_code_1(contained_run):
    assert contained_run.returncode == 1, contained_run.output[-3000:]
    assert sorted(c.hook for c in contained_run.cases) == ["zoo_abort_once_rank1", "zoo_crash_rank1", "zoo_hang_rank1",
                                                           "zoo_os_exit_once_rank1", "zoo_plain_allreduce",
                                                           "zoo_sys_exit_once_rank1"]


def test_hanging_rank_is_reported_with_its_stack(contained_run):
    case = _case(contained_run, "zoo_hang_rank1")
    assert case.outcome == "failed"
    msg = case.message
    assert "did not finish within the case timeout" in msg
    assert "rank 1: did not finish; last phase 'step 0: forward/backward of the hooked model'" in msg
    assert "in hang_on_rank1" in msg, "rank 1's faulthandler stack should show where it hangs"
    assert "the pool was restarted" in msg


def test_dead_rank_is_reported_with_its_exit_code(contained_run):
    case = _case(contained_run, "zoo_crash_rank1")
    assert case.outcome == "failed"
    assert "rank 1: died with exit code 17 during 'step 0: forward/backward of the hooked model'" in case.message
    # os._exit(17) is an exit status of the process's own making: the hook's doing, not run again
    assert "rank 1 ended its own process, exit status 17, in the hook's case" in case.message
    assert "run twice" not in case.message


@pytest.mark.parametrize("hook, how", [("zoo_os_exit_once_rank1", "os._exit"), ("zoo_sys_exit_once_rank1", "sys.exit")])
def test_a_rank_that_ends_its_own_process_once_fails_the_hook_and_is_not_re_run(contained_run, hook, how):
    """Rank 1 calls ``os._exit(3)`` (or ``sys.exit(3)``) at its first call of the run only, so a re-run in fresh
    ranks would pass: the case must fail anyway, with no re-run, and the hook DOES NOT CONFORM (the suite once
    re-ran ``os._exit(3)`` and gave it CONFORMS with a note)."""
    case = _case(contained_run, hook)
    assert case.outcome == "failed", case.message[:3000]
    assert "run twice" not in case.message
    assert f"zoo: rank 1 calls {how}(3) once" in case.message
    if how == "os._exit":
        assert "rank 1: died with exit code 3 during 'step 0: forward/backward of the hooked model'" in case.message
        assert "rank 1 ended its own process, exit status 3" in case.message
    else:  # SystemExit reaches the rank's own code in the hook's thread: reported as what the hook raised
        assert "rank 1: raised SystemExit during 'step 0: forward/backward of the hooked model'" in case.message
    out = contained_run.output
    verdict = next(line for line in out.splitlines() if line.startswith(f"{hook} "))
    assert verdict.split()[1:4] == ["DOES", "NOT", "CONFORM"], verdict
    assert not any(line.startswith(f"  test_averaging[{hook}") for line in out.splitlines()), "listed as re-run"


def test_a_rank_death_that_does_not_recur_in_fresh_ranks_is_re_run_and_reported(contained_run):
    """The first run's rank dies (SIGABRT); the re-run in fresh ranks runs to the end, and its outcome is the case's.
    The suite cannot tell a machine's one-off death from a hook's: the hook's verdict line says a rank died once,
    and the summary keeps the first run's death, with what the rank printed."""
    assert _case(contained_run, "zoo_abort_once_rank1").outcome == "passed"
    out = contained_run.output
    assert "1 case(s) lost a rank and ran once more in fresh ranks (once per hook)" in out
    assert "the suite cannot tell which" in out
    once = next(line for line in out.splitlines() if line.startswith("  test_averaging[zoo_abort_once_rank1"))
    assert ": the second run ran to the end; the first run: " in once
    assert f"rank 1: died with exit code {-signal.SIGABRT} during 'step 0: forward/backward of the hooked model'" in once
    assert "(it printed: zoo: rank 1 aborts once)" in once
    verdict = out[out.index("zoo_abort_once_rank1 "):].splitlines()
    assert verdict[0].split()[1] == "CONFORMS", verdict[0]
    assert verdict[1].strip() == ("a rank died once, in test_averaging[zoo_abort_once_rank1-NO_SHARD-ws2] (rank 1: "
                                  f"died with exit code {-signal.SIGABRT} during 'step 0: forward/backward of the "
                                  "hooked model'); the second run, in fresh ranks, ran to the end: see the summary "
                                  "below")


def test_the_results_file_keeps_each_rerun_with_the_first_runs_ranks(contained_run, zoo_runs):
    path = os.path.join(zoo_runs.directory(CONTAINED_RUN), "contained.json")
    with open(path) as f:
        doc = json.load(f)
    assert results.schema_problems(doc) == []
    reruns = {r["hook"]: r for r in doc["run"]["crash_reruns"]}
    assert sorted(reruns) == ["zoo_abort_once_rank1"], "only a death by a signal is re-run"
    assert reruns["zoo_abort_once_rank1"]["second_run"] == "ran to the end"
    assert "zoo: rank 1 aborts once" in reruns["zoo_abort_once_rank1"]["first_run"]
    assert "died with exit code -6" in reruns["zoo_abort_once_rank1"]["death"]


def test_cases_after_the_broken_ones_still_pass(contained_run):
    assert _case(contained_run, "zoo_plain_allreduce").outcome == "passed"
    # the hang, the crash (not re-run: its exit status is its own), the abort once, the two own exits
    assert "rank pools restarted 5 time(s)" in contained_run.output


def test_an_interrupted_start_kills_the_ranks_already_spawned(monkeypatch):
    """Ctrl-C while a pool spawns its ranks (as fresh interpreters) leaves none of them running."""
    import subprocess

    from conformance.controller import local_pool as pool_mod
    from conformance.controller.pools import PoolConfig
    from conformance.controller.zygote_client import close_zygote

    monkeypatch.setenv("CONFORM_FORK_RANKS", "0")

    spawned = []
    real_popen = subprocess.Popen

    def popen(args, **kw):
        if "conformance.worker" not in args:  # the zoo runs' threads start suites meanwhile: not theirs to fake
            return real_popen(args, **kw)
        if spawned:
            raise KeyboardInterrupt
        proc = real_popen(["sleep", "60"], pass_fds=kw["pass_fds"], start_new_session=True, stdin=subprocess.DEVNULL)
        spawned.append(proc)
        return proc

    monkeypatch.setattr(pool_mod.subprocess, "Popen", popen)
    pool = pool_mod.RankPool(PoolConfig(world_size=3, backend="gloo", device="cpu"))
    with pytest.raises(KeyboardInterrupt):
        pool.launch()
    assert len(spawned) == 1 and spawned[0].poll() is not None, "rank 0 outlived the interrupted start"
    assert not pool.alive


def test_an_interrupted_start_kills_the_forked_ranks_already_spawned(monkeypatch):
    """The same with ranks forked by the zygote: Ctrl-C after the first rank leaves none running."""
    from conformance.controller import local_pool as pool_mod
    from conformance.controller.pools import PoolConfig
    from conformance.controller.zygote_client import close_zygote
    from conformance.controller import zygote_client

    close_zygote()
    spawned = []
    real_spawn = zygote_client._Zygote.spawn

    def spawn(self, sock, log_path, env):
        if spawned:
            raise KeyboardInterrupt
        proc = real_spawn(self, sock, log_path, env)
        spawned.append(proc)
        return proc

    monkeypatch.setattr(zygote_client._Zygote, "spawn", spawn)
    pool = pool_mod.RankPool(PoolConfig(world_size=3, backend="gloo", device="cpu"))
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.launch()
        assert len(spawned) == 1 and spawned[0].wait(timeout=10) is not None, "rank 0 outlived the start"
        assert not pool.alive
    finally:
        close_zygote()


def test_a_case_that_raised_with_a_collective_unmatched_leaves_no_ranks_behind(zoo_runs):
    """The first case raises with an all-reduce of the hook's own group started on rank 0 alone; the default group
    is still in step, so only the check of every group the ranks hold finds that group a collective apart and gets
    the pool rebuilt: the next case runs in fresh ranks and passes (in the old ranks its probe failed)."""
    run = zoo_runs(MID_WAY_RUN)
    first, second = run.by_hook()["zoo_raise_mid_way"]
    assert first.outcome == "xfailed", first.message[:3000]
    assert second.outcome == "passed", second.message[:3000]


def test_a_collective_left_behind_in_a_case_every_rank_finished_fails_that_case(zoo_runs):
    """Rank 0's hook leaves an all-reduce of its own group unjoined and every rank finishes: the check of every
    group after the case finds that group out of step, fails the case that did it, and rebuilds the ranks (so
    each case of the hook, in fresh ranks, does it again and fails)."""
    run = zoo_runs(MID_WAY_RUN)
    for case in run.by_hook()["zoo_leaves_a_collective"]:
        assert case.outcome == "failed", case.name
        assert "after this case the ranks' process groups no longer run a collective in step" in case.message
        # why, in the parentheses, is whichever rank answered first: a sum out of step, a silence, a rank that gloo
        # aborted in that all-reduce, or its peer's "Connection reset by peer"
    # the raising case, then each case of the hook that leaves a collective behind
    assert "rank pools restarted 3 time(s)" in run.output
