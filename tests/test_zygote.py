"""Tests for the zygote: ranks forked from a process that imported torch once (conformance/ranks/zygote.py).

Real pools of 2 gloo ranks on the CPU: the forked ranks join their process
group and answer, run in sessions of their own, report how they died, and
``CONFORM_FORK_RANKS=0`` starts fresh interpreters instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conformance.controller import zygote_client
from conformance.controller.local_pool import RankPool
from conformance.controller.pools import PoolConfig


@pytest.fixture
def fresh_zygote(monkeypatch):
    zygote_client.close_zygote()
    monkeypatch.setattr(zygote_client, "_FORK_UNSAFE", False)
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


#: Run in a fresh interpreter: records every call that would make a later fork() unsafe on a machine with a
#: GPU (a backward pass starts autograd's per-device threads there; CUDA initialised), then runs the
#: zygote's imports and warm-up.
_PRELOAD_PROBE = textwrap.dedent("""
    import json, torch
    calls = []
    def record(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper
    torch.autograd.backward = record("torch.autograd.backward", torch.autograd.backward)
    torch.autograd.grad = record("torch.autograd.grad", torch.autograd.grad)
    torch.cuda.is_available = record("torch.cuda.is_available", torch.cuda.is_available)
    torch.cuda.device_count = record("torch.cuda.device_count", torch.cuda.device_count)
    torch.cuda._lazy_init = record("torch.cuda._lazy_init", torch.cuda._lazy_init)
    from conformance.ranks import zygote
    zygote._preload()
    import torch._dynamo  # what the warm-up is for: the first optimizer step imports it
    print(json.dumps({"calls": calls, "unsafe": zygote.fork_unsafe()}))
""")


def test_the_zygote_warms_up_without_a_backward_pass_or_cuda():
    """On a GPU machine, a backward pass in the zygote made every forked rank's first backward raise
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing"), and the
    suite blamed PyTorch's own hooks for it. The zygote's imports and warm-up call no backward and touch
    no CUDA, and leave it safe to fork."""
    import json

    out = subprocess.run([sys.executable, "-c", _PRELOAD_PROBE], capture_output=True, text=True, timeout=300,
                         env=zygote_client.rank_env())
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe == {"calls": [], "unsafe": None}


def test_fork_unsafe_names_a_running_thread():
    code = textwrap.dedent("""
        import threading
        from conformance.ranks import zygote
        assert zygote.fork_unsafe() is None, zygote.fork_unsafe()
        done = threading.Event()
        threading.Thread(target=done.wait, daemon=True).start()
        print(zygote.fork_unsafe())
        done.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=zygote_client.rank_env())
    assert out.returncode == 0, out.stderr
    assert "it runs 2 threads" in out.stdout


def test_a_zygote_that_cannot_fork_safely_leaves_ranks_to_fresh_interpreters(fresh_zygote, monkeypatch, tmp_path):
    """A zygote with a thread running after its imports (here started by a sitecustomize module, as an
    import of a GPU build can) exits with ZYGOTE_FORK_UNSAFE_EXIT and says why; the pool starts its ranks
    as fresh interpreters, which join and answer, and no zygote is started again this session."""
    (tmp_path / "sitecustomize.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    pool = _pool()
    try:
        pool.start()
        assert all(isinstance(p, subprocess.Popen) for p in pool._procs)
        assert pool._in_step() is None, "the fresh ranks do not answer over their process group"
        assert zygote_client._ZYGOTE.proc.wait(timeout=60) == zygote_client.ZYGOTE_FORK_UNSAFE_EXIT
    finally:
        pool.close()
    assert zygote_client.zygote() is None
    assert zygote_client._FORK_UNSAFE


def test_an_answer_left_by_an_interrupted_request_never_answers_the_next_one():
    """A signal between a request's send and its receive (Ctrl-C while pools close) leaves its answer unread;
    the next STATUS request must pass over it, not read another rank's status (a KeyError before)."""
    import socket
    from multiprocessing.connection import Connection

    from conformance.controller.zygote_client import _Zygote
    from conformance.protocol import Msg, send

    ours, theirs = socket.socketpair()
    handle = object.__new__(_Zygote)
    handle.conn = Connection(ours.detach())
    zygote_end = Connection(theirs.detach())
    send(zygote_end, (Msg.STATUS, {101: None}))  # the interrupted request's answer, never read
    send(zygote_end, (Msg.PID, 103))  # an interrupted spawn's
    send(zygote_end, (Msg.STATUS, {102: 0}))  # the answer to the request below
    assert handle.status([102]) == {102: 0}
    send(zygote_end, (Msg.PID, 104))
    assert handle._reply(Msg.PID, lambda pid: True) == 104
