"""The pytest side of the report files: ``--junitxml``, ``--json`` and ``--markdown`` of one session.

:class:`ReportGuard` runs the steps of :mod:`conformance.reports.report_files` at the
points of a pytest session where they belong: claim at configure time, mark in
``pytest_runtestloop`` (only when cases will run), publish once every
session-finish hook has written its report, release at unconfigure.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, List, Optional

import pytest

from conformance.exit_codes import RUN_ERROR
from conformance.reports.report_files import (ReportFileError, ReportSet, cause, now, placeholder_json, placeholder_junit,
                                      placeholder_markdown)

__all__ = ["PLUGIN_NAME", "ReportGuard"]

#: The name :class:`ReportGuard` is registered under (``config.pluginmanager.get_plugin``).
PLUGIN_NAME = "conformance-report-files"


class ReportGuard:
    """The pytest side of :class:`ReportSet`: ``--junitxml``, ``--json`` and ``--markdown`` of one session.

    Claims the paths at configure time, marks them when the first case is about
    to run, points pytest's JUnit writer at its temporary file, and publishes all
    three once every session-finish hook has written its report (before the
    terminal summary, which names the real paths). A failed write sets the exit
    status to :data:`~conformance.exit_codes.RUN_ERROR` (10).

    Args:
        config: the session's config (``--junitxml`` is read from it).
        json_path, markdown_path: the resolved ``--json`` and ``--markdown`` paths, or ``None``.
        keep: paths never replaced by a placeholder or a progress snapshot (the ``--baseline`` file).

    Raises:
        pytest.UsageError: from the constructor, when a path cannot be claimed (exit 4); none stays claimed.
    """

    def __init__(self, config: pytest.Config, json_path: Optional[str] = None, markdown_path: Optional[str] = None,
                 keep: tuple = ()):
        self.config = config
        self.reports = ReportSet()
        self._after_publish: List[Callable[[], None]] = []
        if hasattr(config, "workerinput"):
            return
        started, pid, host = now(), os.getpid(), socket.gethostname()
        wanted = [("--junitxml", getattr(config.option, "xmlpath", None), lambda: placeholder_junit(started, pid, host)),
                  ("--json", json_path, lambda: placeholder_json(started, pid, host)),
                  ("--markdown", markdown_path, lambda: placeholder_markdown(started, pid, host))]
        try:
            for option, path, placeholder in wanted:
                if path:
                    kept = any(os.path.exists(k) and os.path.exists(path) and os.path.samefile(k, path) for k in keep)
                    self.reports.claim(option, path, None if kept else placeholder)
        except ReportFileError as exc:
            self.reports.release()
            raise pytest.UsageError(str(exc)) from None

    def after_publish(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the reports are published (not when they could not be)."""
        self._after_publish.append(callback)

    def _writer(self) -> Any:
        try:
            from _pytest.junitxml import xml_key  # pytest's private module: optional, checked here
        except ImportError:  # pragma: no cover - a pytest without it writes the report in place
            return None
        return self.config.stash.get(xml_key, None)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        """Mark the reports when cases are about to run; a run that runs none leaves them untouched."""
        collection_failed = session.testsfailed and not session.config.option.continue_on_collection_errors
        if session.config.option.collectonly or not session.items or collection_failed:
            return None
        try:
            self.reports.mark()
        except ReportFileError as exc:
            # Also written here: pytest prints no summary for an exit status that is not its own.
            sys.stderr.write(f"reports: {exc}\n")
            pytest.exit(str(exc), returncode=RUN_ERROR)
        return None

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session):
        junit = self.reports.files.get("--junitxml")
        writer = self._writer() if junit is not None else None
        if writer is not None:
            writer.logfile = junit.temp_path
        try:
            yield
        except OSError as exc:  # pytest's JUnit writer (a full disk): the hooks after it did not run either
            about_junit = junit is not None and exc.filename in (None, junit.temp_path)
            if not self.reports.marked:
                if not about_junit:
                    raise
                # else: a report that would not be published anyway (no case ran, or the run stopped for it)
            elif about_junit:
                self.reports.fail("--junitxml", cause(exc))
            else:
                self.reports.errors.append(f"could not write {exc.filename} as the session finished: {cause(exc)}")
        finally:
            if writer is not None:
                writer.logfile = junit.path
        if not self.reports.marked:
            for report in self.reports.files.values():
                report.discard()
            self._silence(writer)
            return None
        if self.reports.publish():
            for callback in self._after_publish:
                callback()
        else:
            session.exitstatus = RUN_ERROR
            self._silence(writer)
        return None

    def _silence(self, writer: object) -> None:
        """pytest's JUnit writer would print "generated xml file" for a report this run did not publish: it
        is unregistered now (and taken out of the stash, where pytest would look for it to unregister it)."""
        if writer is not None and self.config.pluginmanager.is_registered(writer):
            from _pytest.junitxml import xml_key  # pytest's private module: a writer means it imported

            self.config.pluginmanager.unregister(writer)
            del self.config.stash[xml_key]

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr, reports = terminalreporter, self.reports
        if not reports.files:
            return
        if not reports.marked and not reports.errors:
            tr.write_line(f"reports: no case ran, so {', '.join(r.path for r in reports.files.values())} "
                          "were left as they were")
        for path in reports.published:
            tr.write_line(f"reports: wrote {path}")
        for error in reports.errors:
            tr.write_line(f"reports: {error}", red=True)
        if reports.marked and not reports.published:
            tr.write_line(f"reports: none of the reports was published, so none reads as a finished run (each "
                          f"holds its placeholder or the results so far, marked incomplete); exit status {RUN_ERROR}",
                          red=True)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.reports.release()
