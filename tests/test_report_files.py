"""Report paths are checked, claimed and published atomically (conformance/reports/report_files.py).

Unit tests on :class:`ReportFile` in this process, then the two refusals as a
user meets them: ``python -m conformance`` with an unwritable ``--junitxml``
path, and with a path another live run holds. Both exit 4 before any case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from conformance.reports.report_files import ReportFile, ReportFileError, placeholder_junit
from tests.meta_helpers import REPO

OLD_REPORT = '<?xml version="1.0"?><testsuites><testsuite tests="1"><testcase name="earlier"/></testsuite></testsuites>'


def _claimed(path) -> ReportFile:
    report = ReportFile(str(path), "--junitxml")
    report.claim(placeholder_junit("2030-01-01T00:00:00+00:00", 123, "host"))
    return report


def test_claim_replaces_an_earlier_report_with_a_failing_placeholder(tmp_path):
    path = tmp_path / "reports" / "r.xml"
    path.parent.mkdir()
    path.write_text(OLD_REPORT)
    report = _claimed(path)
    try:
        root = ET.parse(path).getroot()
        error = root.find("./testsuite/testcase/error")
        assert error is not None and "(pid 123 on host) has not finished" in error.get("message")
        assert root.find("./testsuite").get("errors") == "1"
    finally:
        report.release()


def test_publish_renames_the_finished_file_over_the_report_and_release_cleans_up(tmp_path):
    path = tmp_path / "r.xml"
    report = _claimed(path)
    with open(report.temp_path, "w") as f:
        f.write(OLD_REPORT)
    assert os.path.dirname(report.temp_path) == str(tmp_path), "a rename across file systems is not atomic"
    assert report.publish()
    assert path.read_text() == OLD_REPORT and not os.path.exists(report.temp_path)
    report.release()
    assert sorted(os.listdir(tmp_path)) == ["r.xml"], "the lock or a temporary file was left behind"


def test_nothing_written_keeps_the_placeholder(tmp_path):
    report = _claimed(tmp_path / "r.xml")
    assert not report.publish()
    report.release()
    assert "run_did_not_finish" in (tmp_path / "r.xml").read_text()


def test_a_second_claim_on_a_held_path_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "r.xml"
    first = _claimed(path)
    before = path.read_text()
    try:
        with pytest.raises(ReportFileError, match=rf"another conformance run \(pid {os.getpid()} .*\) is writing "
                                                  rf"the report {path} \(--junitxml\)"):
            _claimed(path)
        assert path.read_text() == before
    finally:
        first.release()
    _claimed(path).release()  # free again once the first run let go


def test_a_killed_holder_leaves_no_stale_lock_and_its_partial_file_is_removed(tmp_path):
    path = tmp_path / "r.xml"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from conformance.reports.report_files import ReportFile
        report = ReportFile({str(path)!r}, "--junitxml")
        report.claim("placeholder")
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


def _conform(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "conformance", *args, "-k", "test_averaging", "-p", "no:randomly"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_conform_refuses_an_unwritable_report_path_before_any_case(tmp_path):
    (tmp_path / "afile").write_text("")
    run = _conform(f"--junitxml={tmp_path / 'afile' / 'r.xml'}")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"cannot write the report {tmp_path / 'afile' / 'r.xml'} (--junitxml)" in run.stderr
    assert "passed" not in run.stdout and "failed" not in run.stdout


def test_conform_refuses_a_report_path_another_live_run_holds(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(OLD_REPORT)
    other = ReportFile(str(path), "--junitxml")
    other.claim(OLD_REPORT)  # the other run, alive, with its report in place
    try:
        run = _conform(f"--junitxml={path}")
    finally:
        other.release()
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"another conformance run (pid {os.getpid()} " in run.stderr
    assert path.read_text() == OLD_REPORT, "the refused run touched the other run's report"
