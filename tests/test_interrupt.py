"""Stopping the controller mid-case leaves no rank running, and the run says so.

Each test starts ``python -m conformance`` over ``tests/zoo/contained.py:INTERRUPTIBLE``
(a passing hook, then one that never returns: rank 0 waits on a future nobody
completes, rank 1 sleeps in C holding the GIL), waits until both ranks are inside
the hanging hook, signals the controller, and then checks within a bound of
seconds that every process of that run (found by an environment marker, which
the zygote and every rank inherit) is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from typing import List, Optional, Set

import pytest

from tests.meta_helpers import REPO

#: Seconds the controller gets to exit after the signal (the interrupted path kills the pools at once).
EXIT_BOUND_S = 20.0
#: Seconds every rank and the zygote get to be gone after the controller exited.
ORPHAN_BOUND_S = 5.0
#: The case timeout of these runs: far beyond the test, so only the signal can end the hung case.
CASE_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@dataclasses.dataclass
class Run:
    proc: subprocess.Popen
    marker: str
    junit: str
    out_path: str

    @property
    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()


def _marked(marker: str) -> Set[int]:
    """Pids of live (not zombie) processes whose environment holds ``marker``."""
    found = set()
    needle = marker.encode() + b"\0"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.add(int(name))
    return found


def _start(tmp_path, env_extra: Optional[dict] = None) -> Run:
    tag = uuid.uuid4().hex
    marker = f"CONFORM_TEST_RUN={tag}"
    entered = str(tmp_path / "entered")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CONFORM_TEST_RUN=tag, CONFORM_TEST_HOOK_ENTERED=entered, PYTHONUNBUFFERED="1", **(env_extra or {}))
    junit = str(tmp_path / "report.xml")
    out_path = str(tmp_path / "out.txt")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance", "--hook", "tests.zoo.contained:INTERRUPTIBLE",
             "--extra-world-size", "0", "--case-timeout", str(CASE_TIMEOUT_S), "-k", "test_averaging",
             f"--junitxml={junit}", "--json", str(tmp_path / "results.json"), "-p", "no:randomly"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    run = Run(proc, marker, junit, out_path)
    deadline = time.monotonic() + 180
    while not all(os.path.exists(f"{entered}.rank{r}") for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _cleanup(run)
            pytest.fail(f"the hanging case never started (rc {proc.returncode}):\n{run.output[-3000:]}")
        time.sleep(0.1)
    return run


def _cleanup(run: Run) -> None:
    """Never leave this run's processes on the shared machine, whatever the test found."""
    if run.proc.poll() is None:
        run.proc.kill()
        run.proc.wait()
    for pid in _marked(run.marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(run: Run, signals: List[int]) -> float:
    """Send ``signals`` to the controller (0.3 s apart); the seconds it took to exit."""
    started = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)
        if run.proc.poll() is None:
            run.proc.send_signal(sig)
    try:
        run.proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the controller still runs {EXIT_BOUND_S:g} s after {signals}:\n{run.output[-3000:]}")
    return time.monotonic() - started


def _assert_no_process_left(run: Run, before: Set[int]) -> None:
    deadline = time.monotonic() + ORPHAN_BOUND_S
    left = _marked(run.marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _marked(run.marker)
    assert not left, (f"processes of the run outlived the controller by {ORPHAN_BOUND_S:g} s: {sorted(left)} "
                      f"(the run had {sorted(before)})")


def _run_processes(run: Run, minimum: int) -> Set[int]:
    pids = _marked(run.marker) - {run.proc.pid}
    assert len(pids) >= minimum, f"expected the zygote and 2 ranks, found {sorted(pids)}"
    return pids


def _junit_cases(path: str) -> List[str]:
    """Names of the report's cases (pytest adds a nameless ``<testcase>`` for the one interrupted)."""
    return [tc.get("name") for tc in ET.parse(path).getroot().iter("testcase") if tc.get("name")]


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]], ids=["SIGTERM", "SIGINT-twice"])
def test_a_stopped_run_writes_its_report_says_interrupted_and_leaves_no_rank(tmp_path, signals):
    run = _start(tmp_path)
    try:
        before = _run_processes(run, minimum=3)
        took = _stop(run, signals)
        assert run.proc.returncode == pytest.ExitCode.INTERRUPTED, run.output[-3000:]
        assert took < EXIT_BOUND_S
        _assert_no_process_left(run, before)
        out = run.output
        assert "INTERRUPTED after 1 of 2 cases" in out, out[-3000:]
        assert "CONFORMS" not in out
        assert "zoo_plain_allreduce          INTERRUPTED: no verdict  [1 of 1 cases: 1 passed]" in out
        # The report is valid XML and holds the case that finished; nothing of it is left beside it.
        assert _junit_cases(run.junit) == ["test_averaging[zoo_plain_allreduce-NO_SHARD-ws2]"]
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".report.xml")]
    finally:
        _cleanup(run)


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked-ranks", "fresh-ranks"])
def test_a_killed_controller_leaves_no_rank_and_no_stale_report(tmp_path, fork):
    stale = tmp_path / "report.xml"
    stale.write_text('<?xml version="1.0"?><testsuites><testsuite tests="1" failures="0" errors="0">'
                     '<testcase name="from_an_earlier_run"/></testsuite></testsuites>')
    run = _start(tmp_path, {"CONFORM_FORK_RANKS": fork})
    try:
        before = _run_processes(run, minimum=2 if fork == "0" else 3)
        _stop(run, [signal.SIGKILL])
        assert run.proc.returncode == -signal.SIGKILL
        _assert_no_process_left(run, before)
        # The earlier run's passing report is not left looking current: a placeholder that fails says why.
        root = ET.parse(run.junit).getroot()
        assert _junit_cases(run.junit) != ["from_an_earlier_run"]
        errors = list(root.iter("error"))
        assert errors and f"(pid {run.proc.pid} on " in errors[0].get("message", "") and "has not finished" in \
            errors[0].get("message", ""), ET.tostring(root)[:2000]
        # --json was written as cases finished: the killed run left its results so far, marked incomplete.
        with open(tmp_path / "results.json") as f:
            doc = json.load(f)
        assert doc["run"]["complete"] is False and doc["run"]["exit_status"] == 2
        assert [c["outcome"] for c in doc["cases"]][:1] == ["passed"], doc["cases"]
        assert all(h["status"] == "running" for h in doc["hooks"]), doc["hooks"]
    finally:
        _cleanup(run)


_STOPPING_CHILD = textwrap.dedent("""
    import time
    from conformance.controller.interruption import StopSignals
    signals = StopSignals()
    signals.install()
    try:  # "ready" inside the try: the signal may land while print() is still returning
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", flush=True)
        time.sleep(1.5)  # writing the report
        print("report written", flush=True)
    """)


@pytest.mark.parametrize("count, code, last_line", [
    (2, 0, "report written"),               # the second signal is acknowledged; the report is finished
    (3, 128 + signal.SIGTERM, "interrupted: SIGTERM received"),  # the third stops at once
])
def test_stop_signals(count, code, last_line):
    """Each signal is sent once the child has reacted to the one before (Python coalesces a signal that
    arrives before its handler ran, and a busy machine can delay the handler past a fixed sleep)."""
    child = subprocess.Popen([sys.executable, "-c", _STOPPING_CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "interrupted: SIGTERM received"
        child.send_signal(signal.SIGTERM)
        acknowledged = ""
        while "already stopping, the report is being written" not in acknowledged:
            line = child.stderr.readline()
            assert line, f"the child's stderr ended before it acknowledged the second signal: {acknowledged!r}"
            acknowledged += line
        if count == 3:
            child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=10)
        assert child.returncode == code, acknowledged + err
        lines = ["interrupted: SIGTERM received"] + out.strip().splitlines()
        assert lines[-1] == last_line
    finally:
        child.kill()
        child.wait()


def test_a_run_stopped_by_maxfail_never_says_conforms(tmp_path):
    """-x stops pytest after the first failure: the hooks whose cases did not all run get no verdict, the run
    exits 2 (interrupted, as README says), and the failing hook's grid shows the cases that never ran as such."""
    from tests.meta_helpers import run_suite

    run = run_suite(["--hook", "tests.zoo.fsdp_hooks:ALL", "-x", "--extra-world-size", "0", "-k",
                     "test_averaging and (good_callable_object or bad_sum_no_average or bad_divide_after)"],
                    str(tmp_path / "x.xml"), timeout=300)
    assert run.returncode == 2, run.output[-3000:]
    summary = run.output.split("hook conformance", 1)[-1]
    assert "INTERRUPTED after" in summary and "(stopping after 1 failures)" in summary, summary[:2000]
    assert "CONFORMS" not in summary.replace("DOES NOT CONFORM", ""), summary[:2000]
    failed = [c for c in run.cases if c.outcome == "failed"]
    assert len(failed) == 1, summary[:2000]
    grid = summary.split(f"{failed[0].hook} ", 1)[1].split("\n\n", 1)[0]
    assert "not run" in grid and " only " not in grid, grid
