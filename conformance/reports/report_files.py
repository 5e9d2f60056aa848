"""Report files that never pass for current when they are not: checked, claimed, published atomically.

pytest's JUnit writer opens ``--junitxml`` only when the session finishes. So an
unwritable path lost every result after the whole run, and a killed run left
the previous run's passing report in place for CI to read. Here each report
path is handled by one :class:`ReportFile`, at configure time, before any rank
starts or any case runs:

1. **Checked.** Its directory is created if missing and a file is written
   beside it. A path that cannot be written is a usage error (exit 4) that
   names the path and the cause.
2. **Claimed.** An exclusive ``flock`` on ``.<name>.lock`` beside it, held for
   the whole run. A second run given the same path while the first is alive
   is refused (exit 4) with the first run's pid: two runs would otherwise
   overwrite each other's report, and a CI step could read a report from a
   run other than the one whose exit code it saw. The kernel drops the lock
   when its process dies, even by SIGKILL, so no stale lock is ever left.
3. **Marked.** The report is replaced at once by a placeholder in the same
   format: a JUnit file with one ``<error>`` saying which run started and did
   not finish. A run that is killed leaves it; a CI step that reads it sees a
   failure, never the previous run's green.
4. **Published.** The writer writes to a temporary file beside the report
   (``.<name>.<pid>.partial``), which is renamed over it (``os.replace``,
   atomic within a file system). A reader sees the placeholder or the whole
   report, never half of one.

:class:`JUnitReportGuard` applies this to pytest's ``--junitxml``.
"""

from __future__ import annotations

import datetime
import glob
import os
import socket
from typing import Any, Optional
from xml.sax.saxutils import quoteattr

import pytest

try:  # pragma: no cover - every POSIX system has it
    import fcntl
except ImportError:  # pragma: no cover - Windows: reports are checked and published, not locked
    fcntl = None  # type: ignore[assignment]

__all__ = ["JUnitReportGuard", "ReportFile", "ReportFileError", "placeholder_junit"]


class ReportFileError(Exception):
    """A report path cannot be used by this run; the message names the path, the cause and a fix."""


def placeholder_junit(started: str, pid: int, host: str) -> str:
    """A JUnit document with one error: the run that started at ``started`` (ISO time) has not finished."""
    message = (f"placeholder: the conformance run started at {started} (pid {pid} on {host}) has not finished, "
               "or was stopped before it could write its results")
    return ('<?xml version="1.0" encoding="utf-8"?>\n'
            '<testsuites name="conformance"><testsuite name="conformance" tests="1" errors="1" failures="0" '
            f'skipped="0" timestamp={quoteattr(started)} hostname={quoteattr(host)}>'
            f'<testcase classname="conformance" name="run_did_not_finish"><error message={quoteattr(message)} />'
            '</testcase></testsuite></testsuites>\n')


class ReportFile:
    """One report path of this run.

    Args:
        path: where the report goes (relative to the working directory).
        option: the option that named it, for messages (``--junitxml``).

    Attributes:
        path: the absolute, normalised path.
        temp_path: the temporary file the writer writes, renamed over ``path`` by :meth:`publish`.
    """

    def __init__(self, path: str, option: str):
        self.path = os.path.normpath(os.path.abspath(path))
        self.option = option
        folder, name = os.path.split(self.path)
        self.temp_path = os.path.join(folder, f".{name}.{os.getpid()}.partial")
        self.lock_path = os.path.join(folder, f".{name}.lock")
        self._lock_fd: Optional[int] = None

    def _unwritable(self, exc: OSError) -> ReportFileError:
        why = exc.strerror or str(exc)
        if isinstance(exc, (FileExistsError, NotADirectoryError)):  # from makedirs: a file where a folder should be
            why = "a part of the path is a file, not a directory"
        return ReportFileError(
            f"cannot write the report {self.path} ({self.option}): {why}"
            f"{f' ({exc.filename})' if exc.filename and exc.filename != self.path else ''}. Nothing was run. "
            f"Give {self.option} a path in a directory you can write to (a missing directory is created), "
            "or fix the permissions.")

    def claim(self, placeholder: str) -> None:
        """Check, lock and mark the report before the run starts (steps 1-3 of the module docstring).

        Args:
            placeholder: the text that stands in for the report until :meth:`publish`.

        Raises:
            ReportFileError: the path is a directory or cannot be written, or
                another live run holds it. Nothing is changed then.
        """
        if os.path.isdir(self.path):
            raise ReportFileError(f"the report path {self.path} ({self.option}) is a directory. Nothing was run. "
                                  f"Give {self.option} a file name, such as {os.path.join(self.path, 'conformance.xml')}")
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._lock()
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            self._write_placeholder(placeholder)
        except OSError as exc:
            self.release()
            raise self._unwritable(exc) from None
        # Temporary files of earlier runs that were killed while writing: nobody else holds this path now.
        for stale in glob.glob(os.path.join(glob.escape(os.path.dirname(self.path)),
                                            f".{glob.escape(os.path.basename(self.path))}.*.partial")):
            if stale != self.temp_path:
                try:
                    os.unlink(stale)
                except OSError:
                    pass

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "pid unknown"
                os.close(fd)
                raise ReportFileError(
                    f"another conformance run ({holder}) is writing the report {self.path} ({self.option}) now. "
                    "Two runs would overwrite each other's report, so this one stops before it starts. Wait for "
                    f"that run to finish, or give this run its own {self.option} path.") from None
            # The holder before us may have removed the file after we opened it: lock the file that is there.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode())
        self._lock_fd = fd

    def _write_placeholder(self, text: str) -> None:
        with open(self.temp_path, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(self.temp_path, self.path)

    def publish(self) -> bool:
        """Rename the finished temporary file over the report; False (placeholder kept) when there is none."""
        if not os.path.exists(self.temp_path):
            return False
        os.replace(self.temp_path, self.path)
        return True

    def release(self) -> None:
        """Remove an unpublished temporary file and drop the lock (the lock file goes with it). Idempotent."""
        try:
            os.unlink(self.temp_path)
        except OSError:
            pass
        if self._lock_fd is not None:
            try:  # unlink while still locked, so that a waiting run re-checks the inode (see _lock)
                os.unlink(self.lock_path)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


class JUnitReportGuard:
    """The pytest side: claims ``--junitxml`` at configure time, points pytest's writer at the temporary
    file, and publishes it once written (before the terminal summary, which names the real path).

    Raises:
        pytest.UsageError: from the constructor, when :meth:`ReportFile.claim` fails (exit 4).
    """

    def __init__(self, config: pytest.Config):
        self.config = config
        self.report: Optional[ReportFile] = None
        path = getattr(config.option, "xmlpath", None)
        if not path or hasattr(config, "workerinput"):
            return
        report = ReportFile(path, "--junitxml")
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            report.claim(placeholder_junit(started, os.getpid(), socket.gethostname()))
        except ReportFileError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.report = report

    def _writer(self) -> Any:
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - a pytest without it writes the report in place
            return None
        return self.config.stash.get(xml_key, None)

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session):
        writer = self._writer() if self.report is not None else None
        if writer is not None:
            writer.logfile = self.report.temp_path
        outcome = yield
        if writer is not None:
            writer.logfile = self.report.path
            if getattr(outcome, "excinfo", None) is None:
                self.report.publish()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.report is not None:
            self.report.release()
