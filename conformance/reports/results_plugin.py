"""The pytest side of the results files: the files written at the end, from the bookkeeper's case records.

:func:`register` (called from :func:`conformance.controller.pytest_plugin.pytest_configure`)
adds one :class:`ResultsRecorder` to the session. The session's
:class:`~conformance.reports.bookkeeper.Bookkeeper` builds one
:class:`~conformance.reports.results.CaseRecord` per case from pytest's own
``TestReport`` objects; a case counts once it finished: one that a Ctrl-C cut off is
never listed. While cases run, the recorder rewrites ``--json`` with the cases so far. At
the end of the session it diffs the records with ``--baseline``, applies
``--fail-on regressions`` to the exit status, and hands the ``--json`` and
``--markdown`` texts to the session's
:class:`~conformance.reports.report_guard.ReportGuard`, which publishes them with the
JUnit XML, all or none; ``$GITHUB_STEP_SUMMARY`` gets the Markdown once they
are published. The terminal summary gets each non-conforming hook's grid
(:func:`hook_matrix_lines`) and the baseline diff.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import pytest
import torch

import conformance
from conformance.shared.nccl import nccl_record
from conformance.reports import baseline as baseline_mod
from conformance.reports import known_failures_draft, results
from conformance.reports.bookkeeper import Bookkeeper
from conformance.reports.markdown_summary import markdown_summary
from conformance.reports.matrix import hook_matrix, matrix_text, not_run_records
from conformance.reports.hook_code import hook_code_of
from conformance.reports.cost import cost_regressions, hook_cost, over_max
from conformance.reports.reach import hook_reach, not_checked, reach_context
from conformance.reports.report_guard import PLUGIN_NAME as REPORT_FILES
from conformance.reports.results import CaseRecord
from conformance.reports.source_digest import source_digest
from conformance.reports.verdict import Status, Verdict

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.pytest_plugin import SessionState
    from conformance.reports.report_files import ReportSet
    from conformance.shared.spec_loading import LoadedSpec

__all__ = ["ResultsRecorder", "hook_matrix_lines", "register"]

PLUGIN_NAME = "conformance-results"
#: Where GitHub Actions collects a job's Markdown summary.
GITHUB_STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


#: Seconds between progress writes of ``--json`` while cases run.
PROGRESS_WRITE_S = 2.0


def register(config: pytest.Config, state: SessionState, keeper: Bookkeeper) -> "ResultsRecorder":
    """Add the session's :class:`ResultsRecorder`.

    Loads ``--baseline`` now and validates it against the results schema, so that a bad baseline
    stops the run before any case (a baseline whose entries lack fields would otherwise end the run
    in a traceback, its reports lost), and gives the report guard the ``--json`` placeholder: a
    results document with no case, ``complete: false``.

    Raises:
        pytest.UsageError: the baseline cannot be read, is not a results file of this schema's
            major version, or does not match the schema; the message names the first bad entry and
            field (exit code 4).
    """
    recorder = ResultsRecorder(config, state, keeper)
    s = state.settings
    if s.baseline_path:
        try:
            recorder.baseline_doc = results.load_results(s.baseline_path)
        except results.ResultsError as exc:
            raise pytest.UsageError(f"--baseline: {exc}") from None
    if recorder.reports is not None:
        recorder.reports.set_placeholder("--json", lambda: recorder.json_text(recorder.progress_document()))
    config.pluginmanager.register(recorder, PLUGIN_NAME)
    return recorder


def hook_matrix_lines(config: pytest.Config, hook: str, verdict: Verdict, indent: str = "  ") -> List[str]:
    """The terminal grid of ``hook`` when its verdict's status is ``DOES_NOT_CONFORM``; else no lines."""
    recorder = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if recorder is None or verdict.status is not Status.DOES_NOT_CONFORM:
        return []
    return matrix_text(hook_matrix(recorder.grid_records(recorder.finish_records()), hook), indent=indent)


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


class ResultsRecorder:
    """Writes the results files of the session from the case records its bookkeeper keeps.

    Attributes:
        keeper: the session's :class:`~conformance.reports.bookkeeper.Bookkeeper`, which classified every case.
        baseline_doc: the loaded ``--baseline`` document, or ``None``.
        diff: the :class:`~conformance.reports.baseline.BaselineDiff`, once the session finished.
        reports: the session's report files (:class:`~conformance.reports.report_files.ReportSet`), or ``None``.
        fail_on_applied: the exit status was set by ``--fail-on regressions``.
    """

    def __init__(self, config: pytest.Config, state: SessionState, keeper: Bookkeeper):
        self.config = config
        self.state = state
        self.keeper = keeper
        self.baseline_doc: Optional[Dict[str, Any]] = None
        self.draft: Optional[Tuple[str, int]] = None  # (path, entries) of the known-failures draft written
        self.diff: Optional[baseline_mod.BaselineDiff] = None
        guard = config.pluginmanager.get_plugin(REPORT_FILES)
        self.reports = guard.reports if guard is not None else None
        self._guard = guard
        self.fail_on_applied = False
        self.too_costly: List[str] = []  # --max-cost: each hook over it, once the session finished
        self.notes: List[str] = []
        self._started = time.time()
        self._last_progress = 0.0

    @property
    def suite_items(self) -> int:
        """Conformance cases collected (0 in a run of the project's own tests)."""
        return len(self.keeper.collected)

    @pytest.hookimpl(trylast=True)  # after the bookkeeper has counted the case
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if nodeid in self.keeper.records:
            self._write_progress()

    def _write_progress(self) -> None:
        """Rewrite ``--json`` with the cases so far (``run.complete`` false, every verdict ``RUNNING``), at
        most every :data:`PROGRESS_WRITE_S` seconds, atomically: a run killed mid-way leaves its results up
        to then, marked as incomplete, never a finished-looking file. Never fails the run."""
        now = time.monotonic()
        if self.reports is None or "--json" not in self.reports.files or now - self._last_progress < PROGRESS_WRITE_S:
            return
        self._last_progress = now
        try:
            self.reports.progress("--json", self.json_text(self.progress_document()))
        except Exception as exc:  # noqa: BLE001 - progress is a convenience; the final write reports errors
            self.notes.append(f"could not write the results so far: {exc}")

    def progress_document(self) -> Dict[str, Any]:
        """The document of the run so far: exit status 2 (as for a run stopped now), ``complete`` false."""
        return self.document(int(pytest.ExitCode.INTERRUPTED), self.finish_records(), complete=False, progress=True)

    @staticmethod
    def json_text(doc: Dict[str, Any]) -> str:
        return json.dumps(doc, indent=1, allow_nan=False) + "\n"

    def grid_records(self, records: List[CaseRecord]) -> List[CaseRecord]:
        """``records``, and a not-run record for each collected case that never ran (the grid's only)."""
        return list(records) + not_run_records(self.keeper.collected, records)

    # -- the end of the session ----------------------------------------------------------------

    def finish_records(self) -> List[CaseRecord]:
        """The records of the cases that finished (:meth:`Bookkeeper.finished_records`)."""
        return self.keeper.finished_records()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        s = self.state.settings
        records = self.finish_records()
        costs = self.hook_costs(records)  # the baseline's cost regressions and --max-cost read them
        if self.baseline_doc is not None:
            self.diff = baseline_mod.diff_runs(self.baseline_doc, records, s.baseline_path)
            self.diff.options_changed = baseline_mod.options_changed(
                self.baseline_doc, self.environment(), [item.spec.name for item in self.state.specs],
                [str(a) for a in self.config.invocation_params.args])
            self.diff.new_never_taken = baseline_mod.new_never_taken(self.baseline_doc, self._hook_codes())
            self.diff.cost_regressions = cost_regressions(self.baseline_doc, costs)
            if s.fail_on == "regressions" and int(session.exitstatus) in (0, 1):
                session.exitstatus = (pytest.ExitCode.TESTS_FAILED if self.diff.regressions
                                      else pytest.ExitCode.OK)
                self.fail_on_applied = True
        if s.fail_on == "uncovered" and int(session.exitstatus) == 0 and self.uncovered():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            self.fail_on_applied = True
        self.too_costly = self.over_max_cost(costs)
        if self.too_costly and int(session.exitstatus) == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        # The project's own tests load this plugin too (conftest.py): only a run that collected
        # conformance cases adds to the CI job's summary.
        summary_path = os.environ.get(GITHUB_STEP_SUMMARY, "").strip() if self.suite_items else ""
        reports = self.reports
        if reports is None or not reports.marked:  # no case ran: every report is left as it was
            return
        doc = self.document(int(session.exitstatus), records, complete=self._complete(session, records))
        if self.baseline_doc is None and doc["run"]["complete"]:
            self._write_draft(reports, records, doc)
        reports.stage("--json", lambda: self.json_text(doc))
        reports.stage("--markdown", lambda: markdown_summary(doc))
        if summary_path and self._guard is not None:
            def append() -> None:  # once the reports are published: never a summary of a run whose reports failed
                try:
                    text = markdown_summary(doc)
                    with open(summary_path, "a", encoding="utf-8") as f:
                        f.write(text + "\n")
                except (OSError, ValueError) as exc:  # the job page's summary is a convenience
                    self.notes.append(f"could not append the summary to ${GITHUB_STEP_SUMMARY} ({summary_path}): {exc}")
            self._guard.after_publish(append)

    def hook_costs(self, records: List[CaseRecord]) -> Dict[str, Any]:
        """Each hook under test's :class:`~conformance.reports.cost.Cost` over its measured cases (or ``None``)."""
        return {item.spec.name: hook_cost(records, item.spec.name) for item in self.state.specs}

    def over_max_cost(self, costs: Dict[str, Any]) -> List[str]:
        """``hook: 2.0x bytes`` for each hook whose cost (``costs``: :meth:`hook_costs`) exceeds ``--max-cost`` (none
        where it is not given)."""
        limit = getattr(self.state.settings, "max_cost", None)
        if limit is None:
            return []
        return [f"{hook}: {', '.join(over)} of native's" for hook, c in costs.items()
                for over in [over_max(c, limit)] if over]

    def _write_draft(self, reports: ReportSet, records: List[CaseRecord], doc: Dict[str, Any]) -> None:
        """A red run with no ``--baseline``: the known-failures draft beside its first report
        (:mod:`conformance.reports.known_failures_draft`), said in the terminal; a draft that cannot be written
        is a note, never the run's failure."""
        text = known_failures_draft.draft_text(records, doc["environment"], doc["run"]["started_at"])
        if text is None or not reports.files:
            return
        directory = os.path.dirname(next(iter(reports.files.values())).path)
        try:
            self.draft = (known_failures_draft.write_draft(directory, text), text.count("[[failure]]"))
        except OSError as exc:
            self.notes.append(f"could not write the known-failures draft in {directory}: {exc}")

    def _hook_codes(self) -> Dict[str, Dict[str, Any]]:
        """hook -> its ``hooks[].hook_code``, for each hook under test whose cases ran here."""
        out = {}
        for item in self.state.specs:
            code = hook_code_of(self.state, item.spec.name)
            if code is not None:
                out[item.spec.name] = code.to_json()
        return out

    def uncovered(self) -> List[str]:
        """``hook: file:line`` of each line of a hook's own code with a branch no case took (``--fail-on
        uncovered``)."""
        out = []
        for item in self.state.specs:
            code = hook_code_of(self.state, item.spec.name)
            if code is not None and code.measured:
                out += [f"{item.spec.name}: {where}" for where in code.never_taken_lines()]
        return out

    def _complete(self, session: pytest.Session, records: List[CaseRecord]) -> bool:
        """Every collected case finished, and nothing (a signal, -x, --maxfail) stopped the run."""
        return not self._interrupted(int(session.exitstatus)) and len(records) == self.suite_items

    def _interrupted(self, exit_status: int) -> bool:
        summary = self.config.pluginmanager.get_plugin("conformance-summary")
        return exit_status == int(pytest.ExitCode.INTERRUPTED) or bool(getattr(summary, "interrupted", False))

    def document(self, exit_status: int, records: List[CaseRecord], complete: bool,
                 progress: bool = False) -> Dict[str, Any]:
        """The results document of this session (:func:`conformance.reports.results.build_document`).

        ``complete`` is false for a run that stopped before every case finished. ``progress``: a write
        while cases still run (exit status 2, as for a run stopped there; every hook's verdict ``RUNNING``).
        ``interrupted`` is true for exit status 2 and for a run that -x or --maxfail stopped early.
        """
        finished = time.time()
        run = {"started_at": _utc(self._started), "finished_at": _utc(finished),
               "duration_s": round(finished - self._started, 3), "exit_status": exit_status,
               "interrupted": self._interrupted(exit_status), "complete": complete,
               "fail_on": self.state.settings.fail_on,
               "args": [str(a) for a in self.config.invocation_params.args],
               "crash_reruns": [c.to_json() for c in getattr(self.state.runner, "crash_reruns", ())],
               "counts": self.counts()}
        return results.build_document(
            suite_version=conformance.__version__, source_digest=self.source_digest, run=run,
            environment=self.environment(),
            hooks=[self.hook_entry(item, records, running=progress) for item in self.state.specs], cases=records,
            baseline=None if self.diff is None else self.diff.to_json())

    @functools.cached_property
    def source_digest(self) -> Optional[str]:
        """:func:`~conformance.reports.source_digest.source_digest` of the suite running, read once a session (the
        progress document is written after every case); ``None`` where its files cannot be read."""
        try:
            return source_digest()
        except (ImportError, OSError):
            return None

    def counts(self) -> Dict[str, int]:
        """The counts of pytest's closing line (``382 passed, 43 skipped, 11 deselected, 358 xfailed``), each
        outcome that occurred: what the terminal reporter counts (its ``stats``), deselected cases included."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        stats = getattr(reporter, "stats", {}) or {}
        out = {}
        for outcome in ("failed", "passed", "error", "skipped", "deselected", "xfailed", "xpassed"):
            n = sum(1 for r in stats.get(outcome, ()) if getattr(r, "count_towards_summary", True))
            if n:
                out[outcome] = n
        return out

    def environment(self) -> Dict[str, Any]:
        s = self.state.settings
        hip = getattr(torch.version, "hip", None)
        cuda = getattr(torch.version, "cuda", None)
        return {"torch_version": torch.__version__, "torch_build": "rocm" if hip else ("cuda" if cuda else "cpu"),
                "torch_cuda_version": cuda, "torch_hip_version": hip,
                "python_version": platform.python_version(), "platform": sys.platform,
                "backend": s.backend, "device": s.device,
                "world_sizes": sorted(self.state.world_sizes) or list(s.world_sizes),
                "cpu_pools": list(s.cpu_pools), "gpu_count": s.gpu_count, "case_timeout_s": s.case_timeout_s,
                "hypothesis_examples": s.hypothesis_examples, "known_failures_files": list(s.known_failures),
                "depth": s.depth, "with_compiled_ddp": s.with_compiled_ddp, "nccl": nccl_record(s.backend)}

    def hook_entry(self, item: LoadedSpec, records: List[CaseRecord], running: bool = False) -> Dict[str, Any]:
        """One hook of the JSON ``hooks`` array: its claims, source, verdict, outcome counts, grid."""
        spec = item.spec
        summary = self.config.pluginmanager.get_plugin("conformance-summary")
        verdict = summary.verdict(spec.name) if summary is not None else Verdict(Status.OTHER)
        if running:
            verdict = Verdict.running(sum(1 for r in records if r.hook == spec.name))
        counts: Dict[str, int] = {}
        for rec in records:
            if rec.hook == spec.name:
                counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
        lossy = spec.lossy
        reach = hook_reach(records, spec.name, *reach_context(self.state))
        # A progress document (every few seconds while cases run) leaves the hook code to the final one: summing it
        # up analyses the hook's files with coverage.py, too much to repeat every few seconds.
        code = None if running else hook_code_of(self.state, spec.name)
        cost = hook_cost(records, spec.name)
        return {
            "name": spec.name, "api": spec.api, "reduce_dtype": spec.reduce_dtype_name,
            "param_dtype": spec.param_dtype_name, "native_modes": list(spec.natives()),
            "lossy": None if lossy is None else {"rel_error_bound": lossy.rel_error_bound,
                                                 "deterministic": lossy.deterministic,
                                                 "loss_margin": lossy.loss_margin, "loss_steps": lossy.loss_steps},
            "strategies": list(spec.strategies or ()), "description": spec.description,
            "source": {"kind": _source_kind(item.origin), "target": item.target},
            "verdict": verdict.text, "status": verdict.status.value, "counts": counts,
            "matrix": hook_matrix(self.grid_records(records), spec.name).to_json(),
            "causes": [{"cause": cause, "cases": n, **({"fix": fixes[cause]} if cause in fixes else {}),
                        **({"family": families[cause]} if cause in families else {})}
                       for fixes, families in [(results.hook_fixes(records, spec.name),
                                                results.hook_families(records, spec.name))]
                       for cause, n in results.hook_causes(records, spec.name)],
            "reach": None if reach is None else reach.to_json(),
            "not_checked": [{"reason": reason, "cases": list(items)} for reason, items in not_checked(records, spec.name)],
            "hook_code": None if code is None else code.to_json(),
            "cost": None if cost is None else cost.to_json(),
        }

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr = terminalreporter
        if self.draft is not None:
            path, entries = self.draft
            tr.write_line(f"known failures: drafted {path} ({entries} entries, one per failed case, each reason "
                          "TODO): review every entry before --known-failures; docs/nightly.md, 'The first night'",
                          yellow=True)
        unexplained = (known_failures_draft.unexplained_in_baseline(self.baseline_doc)
                       if self.baseline_doc is not None else [])
        note = known_failures_draft.baseline_note(self.state.settings.baseline_path, unexplained)
        if note is not None:
            tr.write_line(f"baseline: {note}", yellow=True)
        if self.diff is not None:
            tr.section("against the baseline")
            new = bool(self.diff.regressions)
            for i, line in enumerate(baseline_mod.diff_text(self.diff)):
                tr.write_line(line, red=new and i == 0, green=not new and i == 0)
            if self.fail_on_applied and self.state.settings.fail_on == "regressions":
                tr.write_line("--fail-on regressions: exit status 1, for the regressions above" if new else
                              "--fail-on regressions: exit status 0, no new failure against the baseline", red=new)
        if self.state.settings.fail_on == "uncovered" and self.fail_on_applied:
            tr.section("branches no case took (--fail-on uncovered)")
            for line in self.uncovered():
                tr.write_line(line, red=True)
            tr.write_line("--fail-on uncovered: exit status 1: name the switch that takes each (HookSpec(switches="
                          "Switches(...)), docs/hooks.md), or run --depth nightly", red=True)
        if self.too_costly:
            tr.section("cost over --max-cost")
            for line in self.too_costly:
                tr.write_line(line, red=True)
            tr.write_line(f"--max-cost {self.state.settings.max_cost:g}: exit status 1; each hook's cost is in the "
                          "JSON (hooks[].cost, cases[].cost) and docs/cost.md says how it is measured", red=True)
        for note in dict.fromkeys(self.notes):
            tr.write_line(f"results: {note}", yellow=True)


def _source_kind(origin: str) -> str:
    if origin.startswith("entry point"):
        return "entry point"
    return origin  # "--hook" or "built-in"
