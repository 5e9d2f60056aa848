"""The pytest side of the results files: case records from pytest's reports, files written at the end.

:func:`register` (called from :func:`conformance.controller.pytest_plugin.pytest_configure`)
adds one :class:`ResultsRecorder` to the session. It builds one
:class:`~conformance.reports.results.CaseRecord` per case from pytest's own
``TestReport`` objects (``pytest_runtest_logreport``: outcome, duration,
``user_properties``), after ``pytest_runtest_makereport`` has added a failed
case's figures (max ULP and absolute differences over its findings) to the
case's JUnit properties. At the end of the session it diffs the records with
``--baseline``, applies ``--fail-on regressions`` to the exit status, and
writes ``--json`` (atomically), ``--markdown`` and ``$GITHUB_STEP_SUMMARY``.
The terminal summary gets each non-conforming hook's grid
(:func:`hook_matrix_lines`) and the baseline diff.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

import pytest

from conformance.reports import baseline as baseline_mod
from conformance.reports import results
from conformance.reports.matrix import hook_matrix, matrix_text, not_run_records
from conformance.reports.results import FAILING, CaseRecord, figure_value, parse_figure

__all__ = ["ResultsRecorder", "failure_figures", "hook_matrix_lines", "register"]

PLUGIN_NAME = "conformance-results"
#: Findings kept per failed case in the JSON (the JUnit XML has the whole failure).
MAX_FINDINGS_KEPT = 8
#: Where GitHub Actions collects a job's Markdown summary.
GITHUB_STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


#: Seconds between progress writes of ``--json`` while cases run.
PROGRESS_WRITE_S = 2.0


def register(config: pytest.Config, state: Any) -> "ResultsRecorder":
    """Add the session's :class:`ResultsRecorder`.

    Loads ``--baseline`` now, so that a bad baseline stops the run before any
    case, then removes a report left at ``--json`` or ``--markdown`` by an
    earlier run (never the baseline itself), so that a run killed before its end
    leaves no earlier run's report looking current.

    Raises:
        pytest.UsageError: the baseline cannot be read or is not a results file of this
            schema's major version (exit code 4).
    """
    recorder = ResultsRecorder(config, state)
    s = state.settings
    if s.baseline_path:
        try:
            recorder.baseline_doc = results.load_results(s.baseline_path)
        except results.ResultsError as exc:
            raise pytest.UsageError(f"--baseline: {exc}") from None
    for path in (s.json_path, s.markdown_path):
        if path and os.path.exists(path) and not (s.baseline_path and os.path.exists(s.baseline_path)
                                                  and os.path.samefile(path, s.baseline_path)):
            os.unlink(path)
    config.pluginmanager.register(recorder, PLUGIN_NAME)
    return recorder


def hook_matrix_lines(config: pytest.Config, hook: str, verdict: str, indent: str = "  ") -> List[str]:
    """The terminal grid of ``hook`` when its verdict is ``DOES NOT CONFORM``; else no lines."""
    recorder = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if recorder is None or not verdict.startswith("DOES NOT CONFORM"):
        return []
    return matrix_text(hook_matrix(recorder.grid_records(list(recorder.records.values())), hook), indent=indent)


def failure_figures(findings: Any) -> Dict[str, float]:
    """``max_ulp_diff`` and ``max_abs_diff`` over the value mismatches among ``findings``.

    ``findings`` are :class:`conformance.protocol.Finding` objects; a finding
    without a value mismatch (a wrong dtype, shape, or a missing gradient) has no
    figure. Empty when none has one.
    """
    mismatches = [f.mismatch for f in findings if getattr(getattr(f, "mismatch", None), "reason", None) == "values"]
    if not mismatches:
        return {}
    return {"max_ulp_diff": max(float(m.max_ulp_diff) for m in mismatches),
            "max_abs_diff": max(float(m.max_abs_diff) for m in mismatches)}


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


class ResultsRecorder:
    """Records every conformance case of the session and writes the results files.

    Attributes:
        records: node id -> :class:`CaseRecord`, in the order the cases ran.
        baseline_doc: the loaded ``--baseline`` document, or ``None``.
        diff: the :class:`~conformance.reports.baseline.BaselineDiff`, once the session finished.
        written: the paths written at the end.
        errors: why a results file could not be written at the end.
        fail_on_applied: the exit status was set by ``--fail-on regressions``.
        suite_items: conformance cases collected (0 in a run of the project's own tests).
    """

    def __init__(self, config: pytest.Config, state: Any):
        self.config = config
        self.state = state
        self.records: Dict[str, CaseRecord] = {}
        self.baseline_doc: Optional[Dict[str, Any]] = None
        self.diff: Optional[baseline_mod.BaselineDiff] = None
        self.written: List[str] = []
        self.errors: List[str] = []
        self.fail_on_applied = False
        self.suite_items = 0
        self._collected: List[Any] = []  # (node id, case) of every conformance case collected
        self._cases: Dict[str, Any] = {}
        self._failures: Dict[str, Dict[str, Any]] = {}
        self._started = time.time()
        self._last_progress = 0.0

    # -- building records from pytest's reports ------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> None:
        """Before pytest builds the report: a failed case's figures join its JUnit properties, and its
        failure text, first findings and re-run command are kept for its record."""
        if not item.get_closest_marker("conformance"):
            return None
        self._cases.setdefault(item.nodeid, getattr(getattr(item, "callspec", None), "params", {}).get("case"))
        excinfo = call.excinfo
        if excinfo is None or excinfo.errisinstance((pytest.skip.Exception, pytest.xfail.Exception)):
            return None
        exc = excinfo.value
        if call.when == "call":
            for name, value in failure_figures(getattr(exc, "findings", ())).items():
                item.user_properties.append((name, str(figure_value(value))))
        findings = sorted(getattr(exc, "findings", ()),  # as report.findings_text orders them
                          key=lambda f: (f.step if f.step is not None else -1, f.rank, f.fqn or ""))
        message = str(exc).strip() or type(exc).__name__
        self._failures[item.nodeid] = {
            "header": message.splitlines()[0], "findings": [f.describe() for f in findings[:MAX_FINDINGS_KEPT]],
            "message": message[:results.MAX_MESSAGE_CHARS], "rerun": self._rerun(item)}
        return None

    def _rerun(self, item: pytest.Item) -> Optional[str]:
        runner = self.state.runner
        case = self._cases.get(item.nodeid)
        if runner is None or case is None:
            return None
        try:
            return runner.rerun_command(item.name, case.hook, case.world_size)
        except Exception:  # the re-run command is a convenience; never lose the record for it
            return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self._cases:
            return
        rec = self.records.get(report.nodeid)
        if rec is None:
            rec = self.records[report.nodeid] = CaseRecord(id=report.nodeid, name=report.nodeid.split("::")[-1])
            _fill_from_case(rec, self._cases[report.nodeid])
        rec.duration_s += report.duration
        _apply_properties(rec, dict(report.user_properties))
        _apply_outcome(rec, report)
        if rec.outcome in FAILING and rec.failure is None:
            rec.failure = self._failures.get(report.nodeid) or {
                "header": report.head_line or rec.name, "findings": [],
                "message": str(report.longreprtext)[-results.MAX_MESSAGE_CHARS:], "rerun": None}
        if report.when == "teardown":
            self._write_progress()

    def _write_progress(self) -> None:
        """Rewrite ``--json`` with the cases so far (``run.complete`` false, every verdict ``RUNNING``), at
        most every :data:`PROGRESS_WRITE_S` seconds, atomically: a run killed mid-way leaves its results up
        to then, marked as incomplete, never a finished-looking file. Never fails the run."""
        path = self.state.settings.json_path
        now = time.monotonic()
        if not path or now - self._last_progress < PROGRESS_WRITE_S:
            return
        self._last_progress = now
        try:
            records = self.finish_records()
            results.write_json(path, self.document(int(pytest.ExitCode.INTERRUPTED), records, complete=False))
        except Exception as exc:  # noqa: BLE001 - progress is a convenience; the final write reports errors
            self.errors.append(f"could not write progress to {path}: {exc}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.suite_items = sum(1 for item in session.items if item.get_closest_marker("conformance"))
        self._collected = [(item.nodeid, getattr(getattr(item, "callspec", None), "params", {}).get("case"))
                           for item in session.items if item.get_closest_marker("conformance")]

    def grid_records(self, records: List[CaseRecord]) -> List[CaseRecord]:
        """``records``, and a not-run record for each collected case that never ran (the grid's only)."""
        return list(records) + not_run_records(self._collected, records)

    # -- the end of the session ----------------------------------------------------------------

    def finish_records(self) -> List[CaseRecord]:
        """The records, with the check of a case that never ran (no properties) taken from its
        test function's other cases, else from the function's name."""
        checks: Dict[str, str] = {}
        for rec in self.records.values():
            if rec.check:
                checks.setdefault(_function(rec.name), rec.check)
        for rec in self.records.values():
            if not rec.check:
                fn = _function(rec.name)
                rec.check = checks.get(fn) or (fn[len("test_"):] if fn.startswith("test_") else fn)
        return list(self.records.values())

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        s = self.state.settings
        records = self.finish_records()
        if self.baseline_doc is not None:
            self.diff = baseline_mod.diff_runs(self.baseline_doc, records, s.baseline_path)
            if s.fail_on == "regressions" and int(session.exitstatus) in (0, 1):
                session.exitstatus = (pytest.ExitCode.TESTS_FAILED if self.diff.regressions
                                      else pytest.ExitCode.OK)
                self.fail_on_applied = True
        # The project's own tests load this plugin too (conftest.py): only a run that collected
        # conformance cases adds to the CI job's summary.
        summary_path = os.environ.get(GITHUB_STEP_SUMMARY, "").strip() if self.suite_items else ""
        if not (s.json_path or s.markdown_path or summary_path):
            return
        doc = self.document(int(session.exitstatus), records)
        from conformance.reports.markdown_summary import markdown_summary

        if s.json_path:
            self._write(s.json_path, lambda: results.write_json(s.json_path, doc))
        markdown = markdown_summary(doc) if (s.markdown_path or summary_path) else ""
        if s.markdown_path:
            self._write(s.markdown_path, lambda: results.write_atomic(s.markdown_path, markdown))
        if summary_path:
            def append() -> None:
                with open(summary_path, "a", encoding="utf-8") as f:
                    f.write(markdown + "\n")
            self._write(summary_path, append)

    def _write(self, path: str, write: Any) -> None:
        try:
            write()
            self.written.append(path)
        except (OSError, ValueError) as exc:
            self.errors.append(f"could not write {path}: {exc}")

    def document(self, exit_status: int, records: List[CaseRecord], complete: bool = True) -> Dict[str, Any]:
        """The results document of this session (:func:`conformance.reports.results.build_document`).

        ``complete=False``: a progress write while cases still run (exit status 2, as for a run stopped
        there; every hook's verdict ``RUNNING``).
        """
        import conformance

        finished = time.time()
        run = {"started_at": _utc(self._started), "finished_at": _utc(finished),
               "duration_s": round(finished - self._started, 3), "exit_status": exit_status,
               "interrupted": exit_status == int(pytest.ExitCode.INTERRUPTED), "complete": complete,
               "fail_on": self.state.settings.fail_on,
               "args": [str(a) for a in self.config.invocation_params.args]}
        return results.build_document(
            suite_version=conformance.__version__, run=run, environment=self.environment(),
            hooks=[self.hook_entry(item, records, running=not complete) for item in self.state.specs], cases=records,
            baseline=None if self.diff is None else self.diff.to_json())

    def environment(self) -> Dict[str, Any]:
        import torch

        s = self.state.settings
        hip = getattr(torch.version, "hip", None)
        cuda = getattr(torch.version, "cuda", None)
        return {"torch_version": torch.__version__, "torch_build": "rocm" if hip else ("cuda" if cuda else "cpu"),
                "torch_cuda_version": cuda, "torch_hip_version": hip,
                "python_version": platform.python_version(), "platform": sys.platform,
                "backend": s.backend, "device": s.device,
                "world_sizes": sorted(self.state.world_sizes) or list(s.world_sizes),
                "cpu_pools": list(s.cpu_pools), "gpu_count": s.gpu_count, "case_timeout_s": s.case_timeout_s,
                "hypothesis_examples": s.hypothesis_examples, "known_failures_files": list(s.known_failures)}

    def hook_entry(self, item: Any, records: List[CaseRecord], running: bool = False) -> Dict[str, Any]:
        """One hook of the JSON ``hooks`` array: its claims, source, verdict, outcome counts, grid."""
        spec = item.spec
        summary = self.config.pluginmanager.get_plugin("conformance-summary")
        verdict = summary.verdict(spec.name) if summary is not None else ""
        if running:
            verdict = f"RUNNING: {sum(1 for r in records if r.hook == spec.name)} case(s) so far"
        counts: Dict[str, int] = {}
        for rec in records:
            if rec.hook == spec.name:
                counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
        lossy = spec.lossy
        return {
            "name": spec.name, "api": spec.api, "reduce_dtype": spec.reduce_dtype_name,
            "lossy": None if lossy is None else {"rel_error_bound": lossy.rel_error_bound,
                                                 "deterministic": lossy.deterministic,
                                                 "loss_margin": lossy.loss_margin, "loss_steps": lossy.loss_steps},
            "strategies": list(spec.strategies or ()), "description": spec.description,
            "source": {"kind": _source_kind(item.origin), "target": item.target},
            "verdict": verdict, "status": results.hook_status(verdict), "counts": counts,
            "matrix": hook_matrix(self.grid_records(records), spec.name).to_json(),
        }

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        if self.diff is not None:
            tr.section("against the baseline")
            new = bool(self.diff.new_failures)
            for i, line in enumerate(baseline_mod.diff_text(self.diff)):
                tr.write_line(line, red=new and i == 0, green=not new and i == 0)
            if self.fail_on_applied:
                tr.write_line("--fail-on regressions: exit status 1, for the new failures above" if new else
                              "--fail-on regressions: exit status 0, no new failure against the baseline", red=new)
        for path in self.written:
            tr.write_line(f"results: wrote {path}")
        for error in self.errors:
            tr.write_line(f"results: {error}", red=True)


def _source_kind(origin: str) -> str:
    if origin.startswith("entry point"):
        return "entry point"
    return origin  # "--hook" or "built-in"


def _function(name: str) -> str:
    return name.split("[", 1)[0]


def _fill_from_case(rec: CaseRecord, case: Any) -> None:
    """The case's fields from its parameters, for a case skipped before the test set its properties."""
    if case is None:
        return
    rec.hook, rec.api, rec.variant, rec.world_size = case.hook, case.api, case.variant, case.world_size
    rec.model, rec.rule, rec.variant_field = case.model, case.rule, case.variant_field


_STR_FIELDS = ("hook", "api", "check", "variant", "model", "rule")


def _apply_properties(rec: CaseRecord, props: Dict[str, Any]) -> None:
    for name in _STR_FIELDS:
        if props.get(name) is not None:
            setattr(rec, name, str(props[name]))
    if props.get("world_size") is not None:
        rec.world_size = int(props["world_size"])
    for name in results.FIGURE_NAMES:
        if name in props:
            try:
                rec.figures[name] = parse_figure(props[name])
            except (TypeError, ValueError):
                pass


def _apply_outcome(rec: CaseRecord, report: pytest.TestReport) -> None:
    """The case's outcome after this phase's report (setup, call, teardown), pytest's rules for xfail."""
    wasxfail = getattr(report, "wasxfail", None)
    if report.when == "setup":
        if report.skipped:
            if wasxfail is not None:
                rec.outcome, rec.known_failure_reason = "xfailed", wasxfail
            else:
                rec.outcome, rec.skip_reason = "skipped", _skip_reason(report)
        elif report.failed:
            rec.outcome = "error"
    elif report.when == "call":
        if wasxfail is not None:
            rec.outcome = "xpassed" if report.passed else "xfailed"
            rec.known_failure_reason = wasxfail
        elif report.failed and str(report.longrepr).startswith("[XPASS(strict)]"):
            rec.outcome = "xpassed"
            rec.known_failure_reason = str(report.longrepr)[len("[XPASS(strict)]"):].strip()
        else:
            rec.outcome = report.outcome
            if report.skipped:
                rec.skip_reason = _skip_reason(report)
    elif report.failed and rec.outcome not in FAILING:  # teardown
        rec.outcome = "error"


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).replace("Skipped: ", "", 1)
    return str(report.longrepr)
