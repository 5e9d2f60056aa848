"""Tests for the zygote: ranks forked from a process that imported torch once (conformance/ranks/zygote.py).

Real pools of 2 gloo ranks on the CPU: the forked ranks join their process
group and answer, run in sessions of their own, report how they died, and
``CONFORM_FORK_RANKS=0`` starts fresh interpreters instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conformance.controller import zygote_client
from conformance.controller.pool import PoolConfig, RankPool


@pytest.fixture
def fresh_zygote():
    zygote_client.close_zygote()
    yield
    zygote_client.close_zygote()


def _pool() -> RankPool:
    return RankPool(PoolConfig(world_size=2, backend="gloo", device="cpu", start_timeout_s=120.0))


def test_forked_ranks_join_their_group_in_sessions_of_their_own(fresh_zygote):
    pool = _pool()
    try:
        pool.start()
        assert pool.alive
        assert all(isinstance(p, zygote_client._ForkedRank) for p in pool._procs)
        assert all(os.getpgid(p.pid) == p.pid for p in pool._procs), "a rank shares a process group"
        zygote = zygote_client._ZYGOTE
        if os.path.exists(f"/proc/{zygote.proc.pid}/stat"):  # Linux: each rank is the zygote's child
            parents = {int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1]) for p in pool._procs}
            assert parents == {zygote.proc.pid}
        assert pool._in_step() is None, "the forked ranks do not answer over their process group"
    finally:
        pool.close()


def test_a_killed_forked_rank_reports_the_signal_as_popen_does(fresh_zygote):
    pool = _pool()
    try:
        pool.start()
        victim = pool._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert not pool.alive
    finally:
        pool.close()
    assert all(p.poll() is not None for p in pool._procs) or not pool._procs


def test_closing_the_controller_side_ends_the_zygote(fresh_zygote):
    pool = _pool()
    pool.start()
    pool.close()
    zygote = zygote_client._ZYGOTE
    assert zygote is not None and zygote.proc.poll() is None
    zygote_client.close_zygote()
    assert zygote.proc.wait(timeout=10) is not None


def test_no_fork_starts_every_rank_as_a_fresh_interpreter(fresh_zygote, monkeypatch):
    monkeypatch.setenv("CONFORM_FORK_RANKS", "0")
    pool = _pool()
    try:
        pool.start()
        assert all(isinstance(p, subprocess.Popen) for p in pool._procs)
        assert zygote_client._ZYGOTE is None
    finally:
        pool.close()


def test_a_dead_zygote_is_replaced_on_the_next_start(fresh_zygote):
    first = _pool()
    first.start()
    first.close()
    dead = zygote_client._ZYGOTE
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(timeout=10)
    second = _pool()
    try:
        started = time.monotonic()
        second.start()
        assert zygote_client._ZYGOTE is not dead and zygote_client._ZYGOTE.proc.poll() is None
        assert time.monotonic() - started < 120
    finally:
        second.close()
