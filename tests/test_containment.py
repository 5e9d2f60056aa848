"""A hook that hangs or kills a rank is contained: that case fails, the run goes on.

Runs the suite (as a user would) over ``tests/zoo/contained.py``: a hook that
hangs on rank 1, one that exits rank 1 mid-backward, and PyTorch's plain
``allreduce_hook`` after them. The first two must fail with what each rank was
doing, the pool must be rebuilt, and the last must still pass, with the JUnit
report written.
"""

from __future__ import annotations

import os
import pytest

from tests.meta_helpers import BackgroundJob, run_suite


def _contained_run(runs, directory, env):
    return run_suite(["--hook", "tests.zoo.contained:ALL", "--case-timeout", "5", "--extra-world-size", "0",
                      "-k", "test_averaging", "-q"], os.path.join(directory, "contained.xml"), timeout=300, env=env)


#: The run, in the zoo runs' background threads (``tests/conftest.py``).
CONTAINED_RUN = BackgroundJob("contained", _contained_run)


@pytest.fixture(scope="module")
def contained_run(zoo_runs):
    return zoo_runs(CONTAINED_RUN)


def _case(run, hook):
    return next(c for c in run.cases if c.hook == hook)


def test_run_finishes_with_a_report_and_exit_code_1(contained_run):
    assert contained_run.returncode == 1, contained_run.output[-3000:]
    assert sorted(c.hook for c in contained_run.cases) == ["zoo_crash_rank1", "zoo_hang_rank1", "zoo_plain_allreduce"]


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


def test_cases_after_the_broken_ones_still_pass(contained_run):
    assert _case(contained_run, "zoo_plain_allreduce").outcome == "passed"
    assert "rank pools restarted 2 time(s)" in contained_run.output


def test_an_interrupted_start_kills_the_ranks_already_spawned(monkeypatch):
    """Ctrl-C while a pool spawns its ranks (as fresh interpreters) leaves none of them running."""
    import subprocess

    from conformance.controller import pool as pool_mod

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
    pool = pool_mod.RankPool(pool_mod.PoolConfig(world_size=3, backend="gloo", device="cpu"))
    with pytest.raises(KeyboardInterrupt):
        pool.launch()
    assert len(spawned) == 1 and spawned[0].poll() is not None, "rank 0 outlived the interrupted start"
    assert not pool.alive


def test_an_interrupted_start_kills_the_forked_ranks_already_spawned(monkeypatch):
    """The same with ranks forked by the zygote: Ctrl-C after the first rank leaves none running."""
    from conformance.controller import pool as pool_mod
    from conformance.controller import zygote_client

    pool_mod.close_zygote()
    spawned = []
    real_spawn = zygote_client._Zygote.spawn

    def spawn(self, sock, log_path, env):
        if spawned:
            raise KeyboardInterrupt
        proc = real_spawn(self, sock, log_path, env)
        spawned.append(proc)
        return proc

    monkeypatch.setattr(zygote_client._Zygote, "spawn", spawn)
    pool = pool_mod.RankPool(pool_mod.PoolConfig(world_size=3, backend="gloo", device="cpu"))
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.launch()
        assert len(spawned) == 1 and spawned[0].wait(timeout=10) is not None, "rank 0 outlived the start"
        assert not pool.alive
    finally:
        pool_mod.close_zygote()
