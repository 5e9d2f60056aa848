"""Report paths are claimed, marked and published all or none (conformance/reports/report_files.py, report_guard.py).

Unit tests on :class:`ReportFile` and :class:`ReportSet` in this process, then
the run as a user meets it (``python -m conformance``): a path another live run
holds (each of ``--junitxml``, ``--json``, ``--markdown``), an unwritable path,
a run that runs no case, a final write that fails on a full disk, and a
baseline whose entries lack fields.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import types
import xml.etree.ElementTree as ET

import pytest

from conformance.exit_codes import RUN_ERROR
from conformance.reports.report_files import ReportFile, ReportFileError, ReportSet, placeholder_junit, placeholder_markdown
from tests.meta_helpers import REPO

OLD_REPORT = '<?xml version="1.0"?><testsuites><testsuite tests="1"><testcase name="earlier"/></testsuite></testsuites>'
OLD = {"--junitxml": OLD_REPORT, "--json": '{"schema_version": "1.1", "from": "an earlier run"}\n',
       "--markdown": "# an earlier run: CONFORMS\n"}
NAMES = {"--junitxml": "r.xml", "--json": "r.json", "--markdown": "r.md"}
PLACEHOLDERS = {"--junitxml": lambda: placeholder_junit("2030-01-01T00:00:00+00:00", 123, "host"),
                "--json": lambda: '{"run": {"complete": false}}\n',
                "--markdown": lambda: placeholder_markdown("2030-01-01T00:00:00+00:00", 123, "host")}


def _claimed(path) -> ReportFile:
    report = ReportFile(str(path), "--junitxml")
    report.claim()
    return report


def _set(tmp_path, old: bool = True) -> ReportSet:
    """The three reports claimed in ``tmp_path``, each first holding an earlier run's report."""
    reports = ReportSet()
    for option, name in NAMES.items():
        if old:
            (tmp_path / name).write_text(OLD[option])
        reports.claim(option, str(tmp_path / name), PLACEHOLDERS[option])
    return reports


def _full_disk_for(monkeypatch, name: str) -> None:
    """``os.fsync`` of a file whose name contains ``name`` fails as on a full disk."""
    real = os.fsync

    def fsync(fd):
        if name in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def test_claim_checks_and_locks_but_leaves_an_earlier_report_alone(tmp_path):
    path = tmp_path / "reports" / "r.xml"
    path.parent.mkdir()
    path.write_text(OLD_REPORT)
    report = _claimed(path)
    try:
        assert path.read_text() == OLD_REPORT, "claiming (before any case is known to run) changed the report"
        assert sorted(os.listdir(path.parent)) == [".r.xml.lock", "r.xml"]
    finally:
        report.release()


def test_mark_replaces_every_earlier_report_with_a_placeholder(tmp_path):
    reports = _set(tmp_path)
    try:
        reports.mark()
        error = ET.parse(tmp_path / "r.xml").getroot().find("./testsuite/testcase/error")
        assert error is not None and "(pid 123 on host) has not finished" in error.get("message")
        assert json.loads((tmp_path / "r.json").read_text())["run"]["complete"] is False
        assert (tmp_path / "r.md").read_text().startswith("# Conformance: the run has not finished")
    finally:
        reports.release()


def test_publish_renames_every_staged_report_and_release_cleans_up(tmp_path):
    reports = _set(tmp_path)
    reports.mark()
    for option in NAMES:
        reports.stage(option, lambda option=option: f"finished {option}")
    assert all(os.path.dirname(r.temp_path) == str(tmp_path) for r in reports.files.values()), \
        "a rename across file systems is not atomic"
    assert reports.publish(), reports.errors
    assert {name: (tmp_path / name).read_text() for name in NAMES.values()} == {
        name: f"finished {option}" for option, name in NAMES.items()}
    reports.release()
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES.values()), "a lock or a temporary file was left behind"


@pytest.mark.parametrize("failing", list(NAMES))
def test_a_report_that_cannot_be_written_publishes_none_and_keeps_the_placeholders(tmp_path, monkeypatch, failing):
    reports = _set(tmp_path)
    reports.mark()
    placeholders = {name: (tmp_path / name).read_text() for name in NAMES.values()}
    _full_disk_for(monkeypatch, NAMES[failing])
    for option in ("--json", "--markdown"):
        reports.stage(option, lambda option=option: f"finished {option}")
    with open(reports.files["--junitxml"].temp_path, "w") as f:  # as pytest's writer does, without fsync
        f.write(OLD_REPORT)
    assert not reports.publish()
    assert {name: (tmp_path / name).read_text() for name in NAMES.values()} == placeholders
    assert len(reports.errors) == 1 and f"could not write {tmp_path / NAMES[failing]} ({failing}): No space left" \
        in reports.errors[0], reports.errors
    reports.release()
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES.values()), "a temporary file was left behind"


def test_a_rename_that_fails_midway_removes_the_reports_already_renamed(tmp_path, monkeypatch):
    reports = _set(tmp_path)
    reports.mark()
    placeholders = {name: (tmp_path / name).read_text() for name in NAMES.values()}
    for option in NAMES:
        reports.stage(option, lambda option=option: f"finished {option}")
    real = os.replace

    def replace(src, dst):  # the JUnit report is renamed first; the JSON's rename fails
        if dst.endswith("r.json"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    assert not reports.publish()
    assert not (tmp_path / "r.xml").exists(), "a finished report was left beside a run whose other report failed"
    assert [(tmp_path / n).read_text() for n in ("r.json", "r.md")] == [placeholders["r.json"], placeholders["r.md"]]
    assert reports.errors == [f"could not write {tmp_path / 'r.json'} (--json): renaming the finished report over "
                              "it failed: Input/output error"]
    reports.release()
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]


def test_a_placeholder_that_cannot_be_written_removes_the_earlier_report_and_stops_the_run(tmp_path, monkeypatch):
    reports = _set(tmp_path)
    _full_disk_for(monkeypatch, "r.json")
    with pytest.raises(ReportFileError, match=r"cannot write the placeholder of the report .*r\.json \(--json\): "
                                              r"No space left on device; the earlier report there was removed\. "
                                              r"No case was run"):
        reports.mark()
    assert not (tmp_path / "r.json").exists()
    # The reports after it still lose the earlier run's text: none is left looking current.
    assert "has not finished" in (tmp_path / "r.xml").read_text() + (tmp_path / "r.md").read_text()
    assert "earlier" not in (tmp_path / "r.md").read_text() and "earlier" not in (tmp_path / "r.xml").read_text()
    assert not reports.marked
    reports.release()


def test_a_second_claim_on_a_held_path_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(OLD_REPORT)
    first = _claimed(path)
    try:
        with pytest.raises(ReportFileError, match=rf"another conformance run \(pid {os.getpid()} .*\) is writing "
                                                  rf"the report {path} \(--junitxml\)"):
            _claimed(path)
        assert path.read_text() == OLD_REPORT
    finally:
        first.release()
    _claimed(path).release()  # free again once the first run let go


def test_a_killed_holder_leaves_no_stale_lock_and_its_partial_file_is_removed(tmp_path):
    path = tmp_path / "r.xml"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from conformance.reports.report_files import ReportFile
        report = ReportFile({str(path)!r}, "--junitxml")
        report.claim()
        report.replace("placeholder")
        open(report.temp_path, "w").write("half a rep")
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ReportFileError):
            _claimed(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    report = _claimed(path)
    report.release()
    assert sorted(os.listdir(tmp_path)) == ["r.xml"], "the killed run's partial file is still there"


def test_a_path_below_a_file_cannot_be_written(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ReportFileError, match=r"cannot write the report .*afile/r\.xml \(--junitxml\): a part of "
                                              r"the path is a file, not a directory.*Nothing was run"):
        _claimed(tmp_path / "afile" / "r.xml")


# -- the run as a user meets it ------------------------------------------------------------------

#: One passing case on one pool of 2 ranks: the cheapest run that writes every report.
ONE_CASE = ["--hook", "tests.zoo.contained:GOOD", "--extra-world-size", "0", "-k", "test_averaging"]


def _conform(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run([sys.executable, "-m", "conformance", *args, "-p", "no:randomly"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _report_args(tmp_path):
    return [f"{option}={tmp_path / name}" for option, name in NAMES.items()]


def _earlier_reports(tmp_path):
    for option, name in NAMES.items():
        (tmp_path / name).write_text(OLD[option])


def test_conform_refuses_an_unwritable_report_path_before_any_case(tmp_path):
    (tmp_path / "afile").write_text("")
    run = _conform(f"--junitxml={tmp_path / 'afile' / 'r.xml'}", "-k", "test_averaging")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"cannot write the report {tmp_path / 'afile' / 'r.xml'} (--junitxml)" in run.stderr
    assert "passed" not in run.stdout and "failed" not in run.stdout


@pytest.mark.parametrize("option", list(NAMES))
def test_the_guard_refuses_a_report_path_another_live_run_holds_and_claims_none(tmp_path, option):
    """Each of the three options, in this process: :class:`ReportGuard` (what the run builds at configure time)
    raises the usage error that exits 4, and leaves the other run's report alone; the run as a user meets it, on
    one option, is the next test."""
    from conformance.reports.report_guard import ReportGuard

    path = tmp_path / NAMES[option]
    path.write_text(OLD[option])
    other = ReportFile(str(path), option)
    other.claim()  # the other run, alive, with its report in place
    paths = {name: None for name in NAMES}
    paths[option] = str(path)
    config = types.SimpleNamespace(option=types.SimpleNamespace(xmlpath=paths["--junitxml"]))
    try:
        with pytest.raises(pytest.UsageError, match=rf"another conformance run \(pid {os.getpid()} .*\({option}\)"):
            ReportGuard(config, paths["--json"], paths["--markdown"])
    finally:
        other.release()
    assert path.read_text() == OLD[option], "the refused guard touched the other run's report"
    assert sorted(os.listdir(tmp_path)) == [NAMES[option]], "the refused guard left a lock or a temporary file"


@pytest.mark.parametrize("option", ["--junitxml"])
def test_conform_refuses_a_report_path_another_live_run_holds(tmp_path, option):
    path = tmp_path / NAMES[option]
    path.write_text(OLD[option])
    other = ReportFile(str(path), option)
    other.claim()  # the other run, alive, with its report in place
    try:
        run = _conform(*ONE_CASE, f"{option}={path}")
    finally:
        other.release()
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"another conformance run (pid {os.getpid()} " in run.stderr and f"({option})" in run.stderr, run.stderr
    assert path.read_text() == OLD[option], "the refused run touched the other run's report"


@pytest.mark.parametrize("args, code", [(["--collect-only", "-q"], pytest.ExitCode.OK),
                                        (["-k", "no_case_is_called_this"], pytest.ExitCode.NO_TESTS_COLLECTED)],
                         ids=["collect-only", "nothing-selected"])
def test_a_run_that_runs_no_case_leaves_every_report_untouched(tmp_path, args, code):
    _earlier_reports(tmp_path)
    run = _conform(*ONE_CASE[:2], *args, *_report_args(tmp_path))  # one hook's plan: collecting costs less
    assert run.returncode == code, run.stdout[-2000:] + run.stderr[-2000:]
    assert {name: (tmp_path / name).read_text() for name in NAMES.values()} == {
        name: OLD[option] for option, name in NAMES.items()}
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES.values()), "a lock or a temporary file was left behind"
    assert "were left as they were" in run.stdout and "generated xml file" not in run.stdout


@pytest.mark.parametrize("failing", list(NAMES))
def test_a_final_write_that_fails_exits_run_error_and_leaves_no_finished_report(tmp_path, failing):
    _earlier_reports(tmp_path)
    run = _conform(*ONE_CASE, *_report_args(tmp_path), "-p", "tests.report_fault",
                   env_extra={"CONFORM_TEST_FULL_DISK": NAMES[failing]})
    out = run.stdout + run.stderr
    assert run.returncode == RUN_ERROR, out[-3000:]
    assert "1 passed" in run.stdout, "the case itself ran and passed; only the report failed"
    assert f"could not write {tmp_path / NAMES[failing]} ({failing}): No space left on device" in out, out[-3000:]
    assert "generated xml file" not in out, "pytest's JUnit writer claims a report the run did not publish"
    # No report reads as a finished run: each holds its placeholder (the JSON: the results so far, incomplete).
    error = ET.parse(tmp_path / "r.xml").getroot().find("./testsuite/testcase/error")
    assert error is not None and "has not finished" in error.get("message")
    assert json.loads((tmp_path / "r.json").read_text())["run"]["complete"] is False
    assert (tmp_path / "r.md").read_text().startswith("# Conformance: the run has not finished")
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES.values()), "a lock or a temporary file was left behind"


def test_a_full_disk_before_the_first_case_stops_the_run_with_run_error_and_no_earlier_report(tmp_path):
    _earlier_reports(tmp_path)
    run = _conform(*ONE_CASE, *_report_args(tmp_path), "-p", "tests.report_fault",
                   env_extra={"CONFORM_TEST_FULL_DISK": "r.", "CONFORM_TEST_FULL_DISK_AT": "start"})
    out = run.stdout + run.stderr
    assert run.returncode == RUN_ERROR, out[-3000:]
    assert f"cannot write the placeholder of the report {tmp_path / 'r.json'} (--json): No space left on device; " \
           "the earlier report there was removed" in out and "No case was run" in out, out[-3000:]
    assert "passed" not in run.stdout
    assert sorted(os.listdir(tmp_path)) == [], "an earlier run's report (or a lock, or a temporary file) was left"


def test_a_baseline_whose_entries_lack_fields_is_refused_before_the_first_case(tmp_path):
    from tests.test_results import document, overwritten_records

    doc = json.loads(json.dumps(document(overwritten_records())))
    del doc["cases"][2]["outcome"]
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    _earlier_reports(tmp_path)
    run = _conform(*ONE_CASE, *_report_args(tmp_path), "--baseline", str(tmp_path / "baseline.json"),
                   "--fail-on", "regressions")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"--baseline: results file {tmp_path / 'baseline.json'} does not match the results schema" in run.stderr
    assert f"cases[2] (id {doc['cases'][2]['id']!r}) lacks the field 'outcome'" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "passed" not in run.stdout
    assert (tmp_path / "r.json").read_text() == OLD["--json"]
