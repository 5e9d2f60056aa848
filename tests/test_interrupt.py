"""Stopping the controller leaves no rank running, and the run says so, with its reports, exit code 2.

Most tests start ``python -m conformance`` over ``tests/zoo/contained.py:INTERRUPTIBLE``
(a passing hook, then one that never returns: rank 0 waits on a future nobody
completes, rank 1 sleeps in C holding the GIL), wait until both ranks are inside
the hanging hook, signal the controller, and then check within a bound of
seconds that every process of that run (found by an environment marker, which
the zygote and every rank inherit) is gone and what the reports say. Others
signal it while its pools start (``tests/zoo/slow_start.py``), or while it
finishes: writing its reports or closing its pools (``-p tests.slow_finish``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
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


def _start(tmp_path, env_extra: Optional[dict] = None, args: Optional[List[str]] = None,
           wait_for: Optional[List[str]] = None) -> Run:
    """Start a run with every report; return once each file of ``wait_for`` exists (default: both ranks are
    inside the hanging hook of ``INTERRUPTIBLE``'s second case)."""
    tag = uuid.uuid4().hex
    marker = f"CONFORM_TEST_RUN={tag}"
    entered = str(tmp_path / "entered")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CONFORM_TEST_RUN=tag, CONFORM_TEST_HOOK_ENTERED=entered, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("GITHUB_STEP_SUMMARY", None)
    junit = str(tmp_path / "report.xml")
    out_path = str(tmp_path / "out.txt")
    args = args if args is not None else ["--hook", "tests.zoo.contained:INTERRUPTIBLE", "-k", "test_averaging"]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance", *args,
             "--extra-world-size", "0", "--case-timeout", str(CASE_TIMEOUT_S),
             f"--junitxml={junit}", "--json", str(tmp_path / "results.json"),
             "--markdown", str(tmp_path / "summary.md"), "-p", "no:randomly"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    run = Run(proc, marker, junit, out_path)
    wait_for = wait_for if wait_for is not None else [f"{entered}.rank{r}" for r in (0, 1)]
    deadline = time.monotonic() + 180
    while not all(os.path.exists(path) for path in wait_for):
        if proc.poll() is not None or time.monotonic() > deadline:
            _cleanup(run)
            pytest.fail(f"the run never got where the test signals it (rc {proc.returncode}):\n{run.output[-3000:]}")
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


def _stop(run: Run, signals: List[int], release: Optional[str] = None) -> float:
    """Send ``signals`` to the controller (0.3 s apart), then create ``release`` (a run paused by
    ``tests.slow_finish`` goes on); the seconds it took to exit."""
    started = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)
        if run.proc.poll() is None:
            run.proc.send_signal(sig)
    if release is not None:
        time.sleep(0.3)
        open(release, "w").close()
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


def _results(tmp_path) -> dict:
    with open(tmp_path / "results.json") as f:
        return json.load(f)


def _assert_reports_of_a_stopped_run(tmp_path, run: Run, finished: List[str]) -> None:
    """The reports say the run stopped after ``finished`` (case names) and list no other case."""
    assert _junit_cases(run.junit) == finished, run.output[-3000:]
    doc = _results(tmp_path)
    assert (doc["run"]["complete"], doc["run"]["interrupted"], doc["run"]["exit_status"]) == (False, True, 2)
    assert [(c["name"], c["outcome"]) for c in doc["cases"]] == [(name, "passed") for name in finished], doc["cases"]
    assert all(h["status"] == "interrupted" for h in doc["hooks"]), [h["verdict"] for h in doc["hooks"]]
    markdown = (tmp_path / "summary.md").read_text()
    assert "INTERRUPTED" in markdown
    # a hook the run stopped before is not run, never "not selected" (issue 48)
    assert "No case selected" not in markdown
    for hook in doc["hooks"]:
        if not hook["counts"]:
            assert re.search(rf"^Not run \(interrupted\): .*`{hook['name']}`", markdown, re.M), markdown
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "a lock or a temporary file was left behind"


#: One SIGTERM alone; a SIGINT first, then several of each kind (a SIGINT first, then later ones, also in
#: test_signals_while_an_interrupted_run_closes_its_pools_are_only_acknowledged; a SIGTERM first, then later ones,
#: in test_signals_while_the_pools_start_stop_the_run_with_its_reports; 2 and 6 later signals are also each checked
#: alone, on a bare StopSignals, in test_only_the_first_signal_interrupts_and_any_later_one_is_acknowledged).
SIGNAL_SEQUENCES = {
    "SIGTERM": [signal.SIGTERM],
    "SIGINT-then-SIGTERM-and-SIGINT-6-times": [signal.SIGINT] + [signal.SIGTERM, signal.SIGINT] * 3,
}


@pytest.mark.parametrize("signals", list(SIGNAL_SEQUENCES.values()), ids=list(SIGNAL_SEQUENCES))
def test_a_stopped_run_writes_its_report_says_interrupted_and_leaves_no_rank(tmp_path, signals):
    """However many signals follow the first, the run ends with exit code 2 and its reports: a case cut off
    by the signal is in none of them (pytest had logged it as passed: its setup had passed)."""
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
        assert "zoo_plain_allreduce          INTERRUPTED: no verdict  [1 of 1 cases: 1 passed; 4 steps on buffers" in out
        if len(signals) > 1:
            assert "already stopping" in out, out[-3000:]
        _assert_reports_of_a_stopped_run(tmp_path, run, ["test_averaging[zoo_plain_allreduce-NO_SHARD-ws2]"])
    finally:
        _cleanup(run)


def test_signals_while_the_pools_start_stop_the_run_with_its_reports(tmp_path):
    starting = str(tmp_path / "starting")
    run = _start(tmp_path, {"CONFORM_TEST_RANK_STARTING": starting},
                 args=["--hook", "tests.zoo.slow_start:SPEC", "-k", "test_averaging"],
                 wait_for=[f"{starting}.rank{r}" for r in (0, 1)])
    try:
        before = _run_processes(run, minimum=3)
        _stop(run, [signal.SIGTERM, signal.SIGINT, signal.SIGTERM])
        assert run.proc.returncode == pytest.ExitCode.INTERRUPTED, run.output[-3000:]
        _assert_no_process_left(run, before)
        assert "INTERRUPTED after 0 of 1 cases" in run.output, run.output[-3000:]
        _assert_reports_of_a_stopped_run(tmp_path, run, [])
    finally:
        _cleanup(run)


def test_signals_while_an_interrupted_run_closes_its_pools_are_only_acknowledged(tmp_path):
    """The flake of issue 15: a second Ctrl-C that landed while the pools closed ended the controller by
    SIGINT (return code -2), since the handlers had been restored before the pools were closed."""
    closing, release = str(tmp_path / "closing"), str(tmp_path / "release")
    run = _start(tmp_path, {"CONFORM_TEST_SLOW_AT": "close", "CONFORM_TEST_SLOW_MARKER": closing,
                            "CONFORM_TEST_SLOW_UNTIL": release},
                 args=["--hook", "tests.zoo.contained:INTERRUPTIBLE", "-k", "test_averaging", "-p", "tests.slow_finish"])
    try:
        before = _run_processes(run, minimum=3)
        run.proc.send_signal(signal.SIGINT)
        _wait_for(run, closing)
        _stop(run, [signal.SIGINT, signal.SIGTERM, signal.SIGINT], release)
        assert run.proc.returncode == pytest.ExitCode.INTERRUPTED, run.output[-3000:]
        _assert_no_process_left(run, before)
        _assert_reports_of_a_stopped_run(tmp_path, run, ["test_averaging[zoo_plain_allreduce-NO_SHARD-ws2]"])
    finally:
        _cleanup(run)


@pytest.mark.parametrize("at", ["report", "close"])
def test_signals_once_every_case_ran_leave_the_run_its_report_and_exit_code(tmp_path, at):
    """A signal that lands while a finished run writes its reports or closes its pools changes nothing:
    the reports are the complete run's, and the exit code (0) agrees with them."""
    marker, release = str(tmp_path / "finishing"), str(tmp_path / "release")
    run = _start(tmp_path, {"CONFORM_TEST_SLOW_AT": at, "CONFORM_TEST_SLOW_MARKER": marker,
                            "CONFORM_TEST_SLOW_UNTIL": release},
                 args=["--hook", "tests.zoo.contained:GOOD", "-k", "test_averaging", "-p", "tests.slow_finish"],
                 wait_for=[marker])
    try:
        _stop(run, [signal.SIGINT, signal.SIGTERM, signal.SIGINT], release)
        assert run.proc.returncode == pytest.ExitCode.OK, run.output[-3000:]
        assert "the run is finishing: its report is being written, and stands" in run.output, run.output[-3000:]
        _assert_no_process_left(run, set())
        assert _junit_cases(run.junit) == ["test_averaging[zoo_plain_allreduce-NO_SHARD-ws2]"]
        doc = _results(tmp_path)
        assert (doc["run"]["complete"], doc["run"]["interrupted"], doc["run"]["exit_status"]) == (True, False, 0)
        assert [h["status"] for h in doc["hooks"]] == ["conforms"]
    finally:
        _cleanup(run)


def _wait_for(run: Run, path: str) -> None:
    deadline = time.monotonic() + EXIT_BOUND_S
    while not os.path.exists(path):
        if run.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the run never got to {path} (rc {run.proc.returncode}):\n{run.output[-3000:]}")
        time.sleep(0.05)


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
    import sys, time
    from conformance.controller.interruption import StopSignals
    signals = StopSignals()
    signals.install()
    if sys.argv[1] == "finishing":
        signals.finishing()
    try:  # "ready" inside the try: the signal may land while print() is still returning
        print("ready", flush=True)
        if sys.argv[1] == "finishing":
            time.sleep(1.5)  # writing the report
            print("report written", flush=True)
            sys.exit(0)
        time.sleep(60)
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", flush=True)
        time.sleep(1.5)  # writing the report
        print("report written", flush=True)
    """)


def _acknowledged(child: subprocess.Popen, count: int) -> str:
    """Read the child's stderr until ``count`` signals were acknowledged."""
    text = ""
    while text.count("[conformance] SIGTERM:") < count:
        line = child.stderr.readline()
        assert line, f"the child's stderr ended before it acknowledged {count} signal(s): {text!r}"
        text += line
    return text


@pytest.mark.parametrize("count", [2, 6])
def test_only_the_first_signal_interrupts_and_any_later_one_is_acknowledged(count):
    """Each signal is sent once the child has reacted to the one before (Python coalesces a signal that
    arrives before its handler ran, and a busy machine can delay the handler past a fixed sleep)."""
    child = subprocess.Popen([sys.executable, "-c", _STOPPING_CHILD, "running"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "interrupted: SIGTERM received"
        acknowledged = ""
        for _ in range(1, count):
            child.send_signal(signal.SIGTERM)
            acknowledged += _acknowledged(child, 1)
        assert "already stopping" in acknowledged and "send SIGKILL" in acknowledged
        out, err = child.communicate(timeout=10)
        assert child.returncode == 0, acknowledged + err
        assert out.strip().splitlines()[-1] == "report written"
    finally:
        child.kill()
        child.wait()


def test_a_signal_once_the_run_is_finishing_is_only_acknowledged():
    child = subprocess.Popen([sys.executable, "-c", _STOPPING_CHILD, "finishing"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert "the run is finishing: its report is being written, and stands" in _acknowledged(child, 1)
        child.send_signal(signal.SIGTERM)
        _acknowledged(child, 1)
        out, err = child.communicate(timeout=10)
        assert child.returncode == 0 and out.strip() == "report written", out + err
    finally:
        child.kill()
        child.wait()


def test_a_run_stopped_by_maxfail_never_says_conforms(tmp_path):
    """-x stops pytest after the first failure: the hooks whose cases did not all run get no verdict, the run
    exits 2 (interrupted, as README says), and the failing hook's grid shows the cases that never ran as such."""
    from tests.meta_helpers import run_suite

    run = run_suite(["--hook", "tests.zoo.fsdp_hooks:ALL", "-x", "--extra-world-size", "0", "-k",
                     "test_averaging and (good_callable_object or bad_sum_no_average or bad_divide_after)",
                     "--json", str(tmp_path / "x.json")], str(tmp_path / "x.xml"), timeout=300)
    assert run.returncode == 2, run.output[-3000:]
    summary = run.output.split("hook conformance", 1)[-1]
    assert "INTERRUPTED after" in summary and "(stopping after 1 failures)" in summary, summary[:2000]
    assert "CONFORMS" not in summary.replace("DOES NOT CONFORM", ""), summary[:2000]
    failed = [c for c in run.cases if c.outcome == "failed"]
    assert len(failed) == 1, summary[:2000]
    # the hook's block of the summary: its lines up to the next one that starts at column 0 (the next hook, or the
    # counts' banner); pytest's short summary below it repeats the failure text, untruncated where CI is set
    block = summary.split(f"\n{failed[0].hook} ", 1)[1].splitlines()
    grid = "\n".join(itertools.takewhile(lambda line: line.startswith(" ") or not line, block[1:]))
    assert "not run" in grid and " only " not in grid, grid
    with open(tmp_path / "x.json") as f:
        doc = json.load(f)
    assert (doc["run"]["complete"], doc["run"]["interrupted"], doc["run"]["exit_status"]) == (False, True, 2)
    assert "conforms" not in [h["status"] for h in doc["hooks"]]
