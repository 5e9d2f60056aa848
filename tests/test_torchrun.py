"""Across nodes, on torchrun: two torchrun agents on loopback play two nodes of one rank each.

The controller runs as a user runs it (``python -m conformance --listen ...``);
each "node" is ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT -m conformance.worker --controller ...``. The
tests check that:

* the same cases give the same outcomes and messages as the local pool, case by
  case, and a connection with the wrong key meanwhile is refused, summarised
  with its address at the end of the run, and changes nothing; the agents end
  cleanly when the run does;
* containment goes through the elastic agent: a hook that hangs on rank 1 is
  reported with its stack, torchrun restarts the group (``--max-restarts 1``),
  the next case passes on the new ranks, and once the restarts are exhausted
  the remaining case is NOT RUN with that reason (exit 10) and the report is written;
* each hook gets fresh rank processes (the ranks exec afresh, spending no
  torchrun restart), so a hook that patched ``torch.distributed`` cannot make
  the next hook pass.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client
from typing import Iterator, List

import pytest

from conformance.exit_codes import RUN_ERROR
from tests.meta_helpers import REPO, run_suite

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                                reason="torchrun (torch.distributed.run) is not available in this torch build")

KEY = "torchrun-test-secret-0123456789abcdef"
#: One FSDP1 hook with two cases (two sharding strategies on the same ranks), a DDP hook in Python and one in C++:
#: each hook gets ranks of its own on torchrun (an exec of torch in every rank), so each costs seconds.
SUBSET = ("(test_averaging and reduce_scatter_hook) "
          "or (test_ddp_averaging and (ddp_allreduce_hook or ddp_cpp_allreduce))")


#: Ports :func:`_free_port` gave out in this process.
_GIVEN: set = set()


def _free_port() -> int:
    """A loopback port no socket holds now and this process has not been given before. A port is free again as soon
    as its probe closes, so two calls before either port is listened on could return the same one: a CI run gave
    the controller's port to the rendezvous too, and the agents waited on the controller's listener."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@pytest.fixture
def link_env(monkeypatch):
    """The shared secret and loopback-only gloo, for the controller (run_suite) and the agents alike."""
    monkeypatch.setenv("CONFORM_AUTHKEY", KEY)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("CONFORM_AUTHKEY_FILE", raising=False)


@contextlib.contextmanager
def torchrun_nodes(controller: str, tmp_path, *, max_restarts: int = 0) -> Iterator[List[subprocess.Popen]]:
    """Two torchrun agents, one per "node", with the c10d rendezvous on a free loopback port.

    On exit every agent still running gets SIGTERM (it stops its workers), then SIGKILL.
    """
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    try:
        for node in range(2):
            log = open(tmp_path / f"node{node}.log", "wb")
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
                 "--max-restarts", str(max_restarts), "-m", "conformance.worker", "--controller", controller],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        yield agents
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()


def _node_logs(tmp_path) -> str:
    return "\n".join(f"--- node {n} ---\n" + (tmp_path / f"node{n}.log").read_text(errors="replace")[-3000:]
                     for n in range(2))


def _wrong_key_attempt(address, result: dict) -> None:
    """Knock with the wrong key until the controller listens; record how the attempt ended."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            Client(address, authkey=b"the wrong key, long enough to pass")
            result["outcome"] = "accepted"
            return
        except AuthenticationError:
            result["outcome"] = "refused"
            return
        except OSError:
            time.sleep(0.2)
    result["outcome"] = "never listened"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    junit = str(tmp_path_factory.mktemp("local") / "local.xml")
    return run_suite(["--world-size", "2", "--extra-world-size", "0", "--backend", "gloo", "--device", "cpu",
                      "-k", SUBSET, "-q"], junit, timeout=300)


def test_two_nodes_give_the_local_pools_outcomes_and_refuse_a_wrong_key(local_run, link_env, tmp_path):
    """The subset on two torchrun "nodes" matches the local pool case by case; a wrong key changes nothing."""
    port = _free_port()
    controller = f"127.0.0.1:{port}"
    knock: dict = {}
    with torchrun_nodes(controller, tmp_path) as agents:
        intruder = threading.Thread(target=_wrong_key_attempt, args=(("127.0.0.1", port), knock), daemon=True)
        intruder.start()
        remote = run_suite(["--listen", controller, "--listen-timeout", "120", "--world-size", "2",
                            "--extra-world-size", "0", "--backend", "gloo", "--device", "cpu", "-k", SUBSET, "-q"],
                           str(tmp_path / "remote.xml"), timeout=300)
        intruder.join(timeout=10)
        codes = [agent.wait(timeout=60) for agent in agents]
    detail = remote.output[-4000:] + _node_logs(tmp_path)
    assert remote.returncode == local_run.returncode == 0, detail
    assert sorted(c.hook for c in local_run.cases) == ["ddp_allreduce_hook", "ddp_cpp_allreduce", "reduce_scatter_hook",
                                                       "reduce_scatter_hook"]  # FSDP1, DDP in Python and in C++
    assert [(c.name, c.outcome, c.message) for c in remote.cases] == \
        [(c.name, c.outcome, c.message) for c in local_run.cases], detail
    assert knock["outcome"] == "refused"
    assert re.search(rf"--listen {re.escape(controller)}: refused 1 connection from 1 host \(127\.0\.0\.1:\d+\) at "
                     r"[\d:]+: 1 did not know the shared secret \(authentication failed\)\. Nothing was unpickled "
                     r"from a peer before it proved it knows the shared secret", remote.output), detail
    assert codes == [0, 0], f"the torchrun agents should end cleanly when the run ends\n{detail}"


def test_a_hang_is_contained_by_torchrun_restarts_until_they_run_out(link_env, tmp_path):
    """Hang (restart 1 of 1), pass on the new ranks, crash (no restart left), then the last case says why."""
    controller = f"127.0.0.1:{_free_port()}"
    with torchrun_nodes(controller, tmp_path, max_restarts=1) as agents:
        run = run_suite(["--listen", controller, "--listen-timeout", "120", "--world-size", "2",
                         "--extra-world-size", "0", "--backend", "gloo", "--device", "cpu",
                         "--hook", "tests.zoo.torchrun_restarts:ALL", "--case-timeout", "10", "-k", "test_averaging",
                         "-q"], str(tmp_path / "contained.xml"), timeout=300)
        codes = [agent.wait(timeout=60) for agent in agents]
    detail = run.output[-6000:] + _node_logs(tmp_path)
    cases = {c.hook: c for c in run.cases}
    assert list(cases) == ["zoo_hang_rank1", "zoo_plain_allreduce", "zoo_crash_rank1",
                           "zoo_after_the_restarts"], detail

    hang = cases["zoo_hang_rank1"].message
    assert "did not finish within the case timeout on 2 of 2 ranks" in hang and "the pool was restarted" in hang, detail
    assert "rank 1: did not finish; last phase 'step 0: forward/backward of the hooked model'" in hang
    assert "in hang_on_rank1" in hang, "rank 1's stack should show where it hangs"
    assert "in _watch" not in hang, "the rank's own watchdog thread is noise in the stack"

    assert cases["zoo_plain_allreduce"].outcome == "passed", detail

    crash = cases["zoo_crash_rank1"].message
    assert "rank 1: lost its connection to the controller (the process died or was killed" in crash, detail
    assert "the pool was restarted" in crash

    after = cases["zoo_after_the_restarts"]
    assert after.outcome == "skipped" and after.properties.get("not_run"), "no hook is blamed for spent restarts"
    assert "NOT RUN: " in after.message and "torchrun's --max-restarts 1 are used up (rank " in after.message, \
        "the controller should know from the ranks' TORCHELASTIC_RESTART_COUNT that no restart comes, not wait"
    assert run.returncode == RUN_ERROR, "a hook the run could not check makes it a run error"
    assert re.search(r"^zoo_after_the_restarts +NOT RUN \(", run.output, re.MULTILINE), detail
    assert "rank pools restarted 2 time(s)" in run.output
    assert codes == [1, 1], "both agents should give up once their one restart is spent"


def test_each_hook_gets_fresh_processes_on_torchrun_without_spending_a_restart(link_env, tmp_path):
    """A hook whose state factory patches dist.all_reduce (to average every SUM), then a SUM-without-averaging
    hook: the ranks exec afresh for the second hook (no restart: --max-restarts 0), so it fails averaging as it
    does alone, and the first fails with the patch named."""
    controller = f"127.0.0.1:{_free_port()}"
    with torchrun_nodes(controller, tmp_path) as agents:
        run = run_suite(["--listen", controller, "--listen-timeout", "120", "--world-size", "2",
                         "--extra-world-size", "0", "--backend", "gloo", "--device", "cpu",
                         "--hook", "tests.zoo.leaks:TORCHRUN", "-k", "test_ddp_averaging", "-q"],
                        str(tmp_path / "isolated.xml"), timeout=300)
        codes = [agent.wait(timeout=60) for agent in agents]
    detail = run.output[-6000:] + _node_logs(tmp_path)
    cases = {c.hook: c for c in run.cases}
    assert list(cases) == ["leak_patched_all_reduce", "victim_sum"], detail
    assert cases["leak_patched_all_reduce"].outcome == "failed"
    assert "torch.distributed.all_reduce replaced by averaging_all_reduce" in cases["leak_patched_all_reduce"].message
    assert cases["victim_sum"].outcome == "failed", detail
    assert "the hook left" not in cases["victim_sum"].message
    assert codes == [0, 0], f"no restart was spent, and the agents end cleanly\n{detail}"
