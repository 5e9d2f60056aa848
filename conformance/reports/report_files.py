"""Report files that never pass for current when they are not: claimed, marked, published all or none.

pytest's JUnit writer opens ``--junitxml`` only when the session finishes. So an
unwritable path lost every result after the whole run, and a killed run left
the previous run's passing report in place for CI to read. Here the run's three
report paths (``--junitxml``, ``--json``, ``--markdown``) go through one
:class:`ReportSet` of :class:`ReportFile` objects:

1. **Claimed** at configure time, before any rank starts. Each directory is
   created if missing and a file is written and removed beside the report; a
   path that cannot be written is a usage error (exit 4) that names the path and
   the cause. An exclusive ``flock`` on ``.<name>.lock`` beside it is held for the
   whole run: a second run given the same path while the first is alive is
   refused (exit 4) with the first run's pid, since two runs would overwrite
   each other's report and a CI step could read a report from a run other than
   the one whose exit code it saw. The kernel drops the lock when its process
   dies, even by SIGKILL, so no stale lock is ever left. Nothing is changed.
2. **Marked** when the first case is about to run: each report is replaced by a
   placeholder in its own format (a JUnit file whose one ``<error>`` says the
   run has not finished; a JSON document with ``complete: false``; a Markdown
   note). A run that is killed leaves it; a CI step that reads it sees a run that
   did not finish, never the previous run's green. A run that runs no case
   (``--collect-only``, ``-k`` matching nothing, a collection error) is never
   marked and leaves every report as it was.
3. **Published all or none.** Each finished report is written to a temporary
   file beside it (``.<name>.<pid>.partial``) and flushed to disk (``fsync``).
   Only when all of them are written are they renamed over the reports
   (``os.replace``, atomic within a file system). If any write fails (a full
   disk), none is published, the placeholders stay, and the run exits with
   :data:`~conformance.exit_codes.RUN_ERROR`: no file is left that reads as a
   finished run next to an exit code that says otherwise.

:class:`conformance.report_guard.ReportGuard` applies this to a pytest session:
pytest's own JUnit writer is pointed at the temporary file, and
:mod:`conformance.results_plugin` stages the JSON and Markdown texts.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import socket
from typing import Callable, Dict, List, Optional
from xml.sax.saxutils import quoteattr

try:  # pragma: no cover - every POSIX system has it
    import fcntl
except ImportError:  # pragma: no cover - Windows: reports are checked and published, not locked
    fcntl = None  # type: ignore[assignment]

__all__ = ["ReportFile", "ReportFileError", "ReportSet", "placeholder_json", "placeholder_junit",
           "placeholder_markdown"]


class ReportFileError(Exception):
    """A report path cannot be used by this run; the message names the path, the cause and a fix."""


def _not_finished(started: str, pid: int, host: str) -> str:
    return (f"the conformance run started at {started} (pid {pid} on {host}) has not finished, "
            "or was stopped before it could write its results")


def placeholder_junit(started: str, pid: int, host: str) -> str:
    """A JUnit document with one error: the run that started at ``started`` (ISO time) has not finished."""
    message = f"placeholder: {_not_finished(started, pid, host)}"
    return ('<?xml version="1.0" encoding="utf-8"?>\n'
            '<testsuites name="conformance"><testsuite name="conformance" tests="1" errors="1" failures="0" '
            f'skipped="0" timestamp={quoteattr(started)} hostname={quoteattr(host)}>'
            f'<testcase classname="conformance" name="run_did_not_finish"><error message={quoteattr(message)} />'
            '</testcase></testsuite></testsuites>\n')


def placeholder_markdown(started: str, pid: int, host: str) -> str:
    """The Markdown summary's stand-in: a heading that says the run has not finished, and why it may not have."""
    return (f"# Conformance: the run has not finished\n\nThis is a placeholder: "
            f"{_not_finished(started, pid, host)}. It is not a result: see the run's exit code and log.\n")


def placeholder_json(started: str, pid: int, host: str) -> str:
    """A stand-in for ``--json`` that says the run has not finished (the results plugin gives a fuller one:
    a results document with ``complete: false``)."""
    return json.dumps({"placeholder": f"placeholder: {_not_finished(started, pid, host)}",
                       "run": {"complete": False}}) + "\n"


def now() -> str:
    """The local time, ISO 8601 to the second, with its offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


#: The file name suffix of each report, for the example in a message.
_SUFFIX = {"--junitxml": ".xml", "--json": ".json", "--markdown": ".md"}


class ReportFile:
    """One report path of this run.

    Args:
        path: where the report goes (relative to the working directory).
        option: the option that named it, for messages (``--junitxml``).

    Attributes:
        path: the absolute, normalised path.
        temp_path: the temporary file a finished report is staged in, renamed over ``path`` by :meth:`publish`.
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

    def claim(self) -> None:
        """Check that the report can be written and lock it for this run (step 1 of the module docstring).

        The report itself is not touched.

        Raises:
            ReportFileError: the path is a directory or cannot be written, or
                another live run holds it. Nothing is changed then.
        """
        if os.path.isdir(self.path):
            raise ReportFileError(f"the report path {self.path} ({self.option}) is a directory. Nothing was run. "
                                  f"Give {self.option} a file name, such as "
                                  f"{os.path.join(self.path, 'conformance' + _SUFFIX.get(self.option, ''))}")
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._lock()
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            _write_synced(self.temp_path, "")
            os.unlink(self.temp_path)
        except OSError as exc:
            self.release()
            raise self._unwritable(exc) from None
        # Temporary files of earlier runs that were killed while writing: nobody else holds this path now.
        for stale in glob.glob(os.path.join(glob.escape(os.path.dirname(self.path)),
                                            f".{glob.escape(os.path.basename(self.path))}.*.partial")):
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
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {now()}\n".encode())
        self._lock_fd = fd

    def replace(self, text: str) -> None:
        """Replace the report by ``text`` now, atomically (a placeholder, a progress snapshot).

        Raises:
            OSError: the text could not be written; the report is unchanged and no temporary file is left.
        """
        self.stage(text)
        os.replace(self.temp_path, self.path)

    def stage(self, text: str) -> None:
        """Write ``text`` to :attr:`temp_path`, flushed to disk, for :meth:`publish`.

        Raises:
            OSError: as :meth:`replace`.
        """
        _write_synced(self.temp_path, text)

    def staged(self) -> bool:
        return os.path.exists(self.temp_path)

    def sync_staged(self) -> None:
        """Flush a temporary file someone else wrote (pytest's JUnit writer) to disk; raises OSError."""
        fd = os.open(self.temp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self) -> bool:
        """Rename the staged file over the report; False (report unchanged) when none is staged.

        Raises:
            OSError: the rename failed.
        """
        if not self.staged():
            return False
        os.replace(self.temp_path, self.path)
        return True

    def discard(self) -> None:
        """Remove a staged file that will not be published. Idempotent."""
        try:
            os.unlink(self.temp_path)
        except OSError:
            pass

    def release(self) -> None:
        """Remove an unpublished temporary file and drop the lock (the lock file goes with it). Idempotent."""
        self.discard()
        if self._lock_fd is not None:
            try:  # unlink while still locked, so that a waiting run re-checks the inode (see _lock)
                os.unlink(self.lock_path)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


def _write_synced(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` and ``fsync`` it: a full disk shows here, not after the rename."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise


def cause(exc: BaseException) -> str:
    """An exception in a few words: its ``strerror`` (``No space left on device``), else its text."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


class ReportSet:
    """The run's report files, by option: claimed together, marked together, published all or none.

    Attributes:
        files: option (``--junitxml``, ``--json``, ``--markdown``) -> :class:`ReportFile`.
        marked: the placeholders are in place (a case is about to run); only a marked set is published.
        errors: why a report could not be marked, staged or published, one line each.
        published: the paths published, once :meth:`publish` succeeded.
    """

    def __init__(self) -> None:
        self.files: Dict[str, ReportFile] = {}
        self._placeholders: Dict[str, Optional[Callable[[], str]]] = {}
        self.marked = False
        self.errors: List[str] = []
        self.published: List[str] = []

    def claim(self, option: str, path: str, placeholder: Optional[Callable[[], str]]) -> ReportFile:
        """Claim ``path`` for ``option`` (:meth:`ReportFile.claim`); ``placeholder`` makes its stand-in text
        when the set is marked (``None``: the file is left as it is until published, for the baseline file).

        Raises:
            ReportFileError: as :meth:`ReportFile.claim`; the reports claimed before stay claimed.
        """
        report = ReportFile(path, option)
        report.claim()
        self.files[option] = report
        self._placeholders[option] = placeholder
        return report

    def mark(self) -> None:
        """Put every placeholder in place (step 2).

        Raises:
            ReportFileError: a placeholder could not be written. That report is removed instead (so no
                earlier run's report is left looking current) where it can be, and the others still get
                their placeholders; the run must not go on, since its own report could not be written
                either. Each report's message is also in :attr:`errors`.
        """
        failed = []
        for option, report in self.files.items():
            make = self._placeholders[option]
            if make is None:
                continue
            try:
                report.replace(make())
            except Exception as exc:  # noqa: BLE001 - an OSError, or a placeholder that could not be made
                try:
                    os.unlink(report.path)
                    removed = "the earlier report there was removed"
                except FileNotFoundError:
                    removed = "there was no earlier report"
                except OSError as gone:
                    removed = f"the earlier report could not be removed either ({cause(gone)})"
                failed.append(f"cannot write the placeholder of the report {report.path} ({option}): {cause(exc)}; "
                              f"{removed}")
        if failed:
            self.errors += failed
            raise ReportFileError("; ".join(failed) + ". No case was run, since this run could not write its own "
                                  "report either. Free space there, or give the option another path.")
        self.marked = True

    def set_placeholder(self, option: str, placeholder: Callable[[], str]) -> None:
        """Give ``option``'s report another placeholder (not for a file claimed with none: the baseline)."""
        if self._placeholders.get(option) is not None:
            self._placeholders[option] = placeholder

    def progress(self, option: str, text: str) -> None:
        """Replace ``option``'s report by a snapshot of the run so far (a marked set only; never the baseline).

        Raises:
            OSError: as :meth:`ReportFile.replace`.
        """
        report = self.files.get(option)
        if self.marked and report is not None and self._placeholders.get(option) is not None:
            report.replace(text)

    def stage(self, option: str, text: Callable[[], str]) -> None:
        """Stage ``option``'s finished report, made by ``text()``; a failure (of ``text()`` too) is recorded
        in :attr:`errors`, and the set is then not published."""
        report = self.files.get(option)
        if report is None:
            return
        try:
            report.stage(text())
        except Exception as exc:  # noqa: BLE001 - whatever stops a report stops its publication, never the run
            self.errors.append(f"could not write {report.path} ({option}): {cause(exc)}")

    def fail(self, option: str, why: str) -> None:
        """Record that ``option``'s report could not be written (by a writer other than :meth:`stage`)."""
        report = self.files.get(option)
        self.errors.append(f"could not write {report.path if report else option} ({option}): {why}")

    def publish(self) -> bool:
        """Publish every staged report, or none (step 3). False, with :attr:`errors` saying why, when a report
        was not staged, could not be flushed to disk or renamed; the placeholders then stay (a report already
        renamed over its path in this call is removed again)."""
        for option, report in self.files.items():
            if self.errors:
                break
            try:
                if not report.staged():
                    self.fail(option, "the report was not written (see the errors above)")
                elif option == "--junitxml":  # written by pytest, which does not flush it to disk
                    report.sync_staged()
            except OSError as exc:
                self.fail(option, cause(exc))
        done: List[ReportFile] = []
        if not self.errors:
            for option, report in self.files.items():
                try:
                    report.publish()
                    done.append(report)
                except OSError as exc:
                    self.fail(option, f"renaming the finished report over it failed: {cause(exc)}")
                    break
        if self.errors:
            for report in done:  # half a set would be a finished-looking report beside a failed run
                try:
                    os.unlink(report.path)
                except OSError:
                    pass
            for report in self.files.values():
                report.discard()
            return False
        self.published = [report.path for report in self.files.values()]
        return True

    def release(self) -> None:
        for report in self.files.values():
            report.release()
