"""The one place that classifies pytest's reports of the conformance cases, per case and per hook.

:class:`Bookkeeper` is a pytest plugin object, registered by
:func:`conformance.controller.pytest_plugin.pytest_configure` as :data:`PLUGIN_NAME`. It
receives every ``TestReport`` (setup, call, teardown) of a conformance case and classifies
it once (:func:`phase_outcome`, pytest's rules for skips and known failures). From that it
keeps:

* one :class:`~conformance.reports.results.CaseRecord` per case (outcome, duration, JUnit
  properties, figures as floats, a failure's text), what the JSON, the Markdown, the grid
  and the baseline diff read;
* one :class:`HookTally` per hook (outcome counts, failed checks, known-failure and skip
  reasons, world sizes), what each hook's verdict
  (:func:`conformance.reports.report.hook_verdict`) and the terminal summary read.

A hook's tally counts a case's call report, or its setup report when that did not pass,
once the case names its hook (its ``hook`` property, or its id for a case skipped before
its test ran): a teardown error changes the case's record (``error``), not the tally.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import pytest

from conformance.cases import parse_case_id
from conformance.reports import results
from conformance.reports.cost import COST_PROPERTY, parse_property
from conformance.reports.reach import REACH_PROPERTIES
from conformance.reports.results import FAILING, CaseRecord, Figure
from conformance.reports.session_report import notset_cause

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.pytest_plugin import SessionState
    from conformance.protocol import Finding

__all__ = ["Bookkeeper", "HookTally", "PLUGIN_NAME", "case_hook", "case_of", "failure_figures", "phase_outcome",
           "skip_reason"]

#: The name :class:`Bookkeeper` is registered under (``config.pluginmanager.get_plugin``).
PLUGIN_NAME = "conformance-bookkeeper"
#: Findings kept per failed case in the JSON (the JUnit XML has the whole failure).
MAX_FINDINGS_KEPT = 8
#: How pytest's report of a strict known failure that passed begins (``xfail(strict=True)``).
_STRICT_XPASS = "[XPASS(strict)]"


def case_of(item: pytest.Item) -> Optional[Any]:
    """The item's :class:`~conformance.cases.CaseParams`, or ``None`` for a test that is not a case."""
    return getattr(getattr(item, "callspec", None), "params", {}).get("case")


def case_hook(item: pytest.Item) -> Optional[str]:
    """The hook name of the item's case, or ``None``."""
    return getattr(case_of(item), "hook", None)


def skip_reason(report: pytest.TestReport) -> str:
    """Why pytest skipped the case, without pytest's ``Skipped: `` prefix."""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).replace("Skipped: ", "", 1)
    return str(report.longrepr)


def phase_outcome(report: pytest.TestReport) -> Tuple[Optional[str], Optional[str]]:
    """What one phase's report says of its case: ``(outcome, reason)``, pytest's rules for skips and xfail.

    ``outcome`` is one of :data:`~conformance.reports.results.OUTCOMES`, or ``None`` for a report
    that leaves the case as it was (a passed setup or teardown); ``reason`` is the known-failures
    entry's reason of ``xfailed`` and ``xpassed``, the skip reason of ``skipped``, else ``None``.
    A setup or teardown that failed is ``error``.
    """
    wasxfail = getattr(report, "wasxfail", None)
    if report.when == "setup":
        if report.skipped:
            return ("xfailed", wasxfail) if wasxfail is not None else ("skipped", skip_reason(report))
        return ("error", None) if report.failed else (None, None)
    if report.when == "call":
        if wasxfail is not None:
            return ("xpassed" if report.passed else "xfailed"), wasxfail
        if report.failed and str(report.longrepr).startswith(_STRICT_XPASS):
            return "xpassed", str(report.longrepr)[len(_STRICT_XPASS):].strip()
        return report.outcome, (skip_reason(report) if report.skipped else None)
    return ("error", None) if report.failed else (None, None)


def failure_figures(findings: Iterable[Finding]) -> Dict[str, Figure]:
    """``max_ulp_diff`` and ``max_abs_diff`` over the value mismatches among ``findings``, as floats.

    ``findings`` are :class:`conformance.protocol.Finding` objects; a finding
    without a value mismatch (a wrong dtype, shape, or a missing gradient) has no
    figure. Empty when none has one.
    """
    mismatches = [f.mismatch for f in findings if getattr(getattr(f, "mismatch", None), "reason", None) == "values"]
    if not mismatches:
        return {}
    return {"max_ulp_diff": Figure(max(float(m.max_ulp_diff) for m in mismatches)),
            "max_abs_diff": Figure(max(float(m.max_abs_diff) for m in mismatches))}


@dataclasses.dataclass
class HookTally:
    """What one hook's cases gave, for its verdict and its lines in the terminal summary.

    Attributes:
        counts: outcome -> cases (``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``).
        failed_checks: the checks of its failed cases, and what a case left behind (``memory growth``).
        known_failure_reasons: the reasons of its xfailed cases.
        skip_reasons: why its cases were skipped before they ran -> how many.
        ran_at: the world sizes its cases ran at (skipped ones excluded).
        not_run: why some of its cases could not run (the run's own failure).
    """

    counts: Dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    failed_checks: Set[str] = dataclasses.field(default_factory=set)
    known_failure_reasons: Set[str] = dataclasses.field(default_factory=set)
    skip_reasons: Dict[str, int] = dataclasses.field(default_factory=dict)
    ran_at: Set[int] = dataclasses.field(default_factory=set)
    not_run: Set[str] = dataclasses.field(default_factory=set)


class Bookkeeper:
    """Receives every report of the session's conformance cases and classifies each once.

    Args:
        state: the session's :class:`~conformance.controller.pytest_plugin.SessionState` (the hooks under
            test, and the runner for a failed case's re-run command).

    Attributes:
        records: node id -> :class:`CaseRecord`, in the order the cases ran.
        hooks: hook name -> :class:`HookTally`, for the hooks whose cases reported.
        xpassed: node ids of the known failures that passed.
        tests_at: world size -> the suite tests whose cases ran there (skipped ones excluded).
        planned: hook name -> cases collected; ``collected``: ``(node id, CaseParams)`` of each.
        cases_run: cases that finished (setup, call and teardown).
        deselected: names of the cases ``-k`` or ``-m`` deselected; ``deselected_of``: how many, per hook.
        empty_tests: suite tests with no case for the hooks under test (pytest's ``[NOTSET]``) ->
            :func:`conformance.reports.session_report.notset_cause`.
    """

    def __init__(self, state: SessionState):
        self.state = state
        self.records: Dict[str, CaseRecord] = {}
        self.hooks: Dict[str, HookTally] = {}
        self.xpassed: List[str] = []
        self.tests_at: Dict[int, Set[str]] = defaultdict(set)
        self.planned: Dict[Optional[str], int] = defaultdict(int)
        self.collected: List[Tuple[str, Any]] = []
        self.cases_run = 0
        self.deselected: List[str] = []
        self.deselected_of: Dict[Optional[str], int] = defaultdict(int)
        self.empty_tests: Dict[str, Tuple[str, bool]] = {}
        self._cases: Dict[str, Any] = {}
        self._finished: Set[str] = set()
        self._collected_ids: Set[str] = set()
        self._failures: Dict[str, Dict[str, Any]] = {}

    # -- collection ----------------------------------------------------------------------------

    def pytest_deselected(self, items: List[pytest.Item]) -> None:
        for item in items:
            if not item.get_closest_marker("conformance"):
                continue
            if item.name.endswith("[NOTSET]"):
                test = item.name[:-len("[NOTSET]")]
                self.empty_tests[test] = notset_cause(test, [i.spec for i in self.state.specs])
            else:
                self.deselected.append(item.name)
                self.deselected_of[case_hook(item)] += 1

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            if item.get_closest_marker("conformance"):  # the project's own tests load this plugin too
                self.planned[case_hook(item)] += 1
                self.collected.append((item.nodeid, case_of(item)))
                self._collected_ids.add(item.nodeid)

    def tally(self, hook: str) -> HookTally:
        """``hook``'s tally (an empty one for a hook none of whose cases reported)."""
        return self.hooks.get(hook) or HookTally()

    # -- the reports ---------------------------------------------------------------------------

    def note_report(self, item: pytest.Item, call: pytest.CallInfo) -> None:
        """Before pytest builds a phase's report (the plugin's ``pytest_runtest_makereport`` calls it): a failed
        case's figures join its JUnit properties (as floats, :class:`~conformance.reports.results.Figure`), and
        its failure text, first findings and re-run command are kept for its record."""
        if not item.get_closest_marker("conformance"):
            return None
        self._cases.setdefault(item.nodeid, case_of(item))
        excinfo = call.excinfo
        if excinfo is None or excinfo.errisinstance((pytest.skip.Exception, pytest.xfail.Exception)):
            return None
        exc = excinfo.value
        if call.when == "call":
            item.user_properties.extend(failure_figures(getattr(exc, "findings", ())).items())
        findings = sorted(getattr(exc, "findings", ()),  # as report.findings_text orders them
                          key=lambda f: (f.step if f.step is not None else -1, f.rank, f.fqn or ""))
        message = str(exc).strip() or type(exc).__name__
        self._failures[item.nodeid] = {
            "header": message.splitlines()[0], "findings": [f.describe() for f in findings[:MAX_FINDINGS_KEPT]],
            "message": message[:results.MAX_MESSAGE_CHARS], "rerun": self._rerun(item),
            **results.cause_fields(c for f in findings for c in getattr(f, "causes", ()))}
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
        outcome, reason = phase_outcome(report)
        props = dict(report.user_properties)
        self._record(report, props, outcome, reason)
        self._tally(report, props, outcome, reason)

    def _record(self, report: pytest.TestReport, props: Dict[str, Any], outcome: Optional[str],
                reason: Optional[str]) -> None:
        rec = self.records.get(report.nodeid)
        if rec is None:
            rec = self.records[report.nodeid] = CaseRecord(id=report.nodeid, name=report.nodeid.split("::")[-1])
            _fill_from_case(rec, self._cases[report.nodeid])
        rec.duration_s += report.duration
        _apply_properties(rec, props)
        if outcome is not None and not (report.when == "teardown" and rec.outcome in FAILING):
            rec.outcome = outcome
            if outcome in ("xfailed", "xpassed"):
                rec.known_failure_reason = reason
            elif outcome == "skipped":
                rec.skip_reason = reason
        if rec.outcome in FAILING and rec.failure is None:
            rec.failure = self._failures.get(report.nodeid) or {
                "header": report.head_line or rec.name, "findings": [],
                "message": str(report.longreprtext)[-results.MAX_MESSAGE_CHARS:], "rerun": None}

    def _tally(self, report: pytest.TestReport, props: Dict[str, Any], outcome: Optional[str],
               reason: Optional[str]) -> None:
        hook = props.get("hook")
        if hook is None and report.when == "setup" and outcome in ("skipped", "xfailed"):
            hook = self._hook_of_id(report.nodeid)  # skipped before the test body named its hook
            if hook is not None and outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons = self.hooks.setdefault(hook, HookTally()).skip_reasons
                reasons[reason] = reasons.get(reason, 0) + 1
        if hook is None or outcome is None or report.when == "teardown":
            return
        tally = self.hooks.setdefault(hook, HookTally())
        if outcome == "error":  # a setup that failed: pytest's outcome, as the hook's verdict counts it
            outcome = "failed"
        if outcome == "xpassed":
            self.xpassed.append(report.nodeid)
        elif outcome == "xfailed":
            tally.known_failure_reasons.add(reason)
        elif outcome == "failed":
            tally.failed_checks.add(props.get("failed_check") or props.get("check", "?"))
            tally.failed_checks.update(label for key, label in report.user_properties if key == "leak")
        if outcome not in ("xpassed", "xfailed") and "not_run" in props:
            tally.not_run.add(props["not_run"])
        if outcome != "skipped" and props.get("world_size") is not None:
            tally.ran_at.add(int(props["world_size"]))
            self.tests_at[int(props["world_size"])].add(report.nodeid.rsplit("::", 1)[-1].split("[", 1)[0])
        tally.counts[outcome] += 1

    def _hook_of_id(self, nodeid: str) -> Optional[str]:
        """The hook that leads the case id, if it is a hook under test."""
        try:
            hook = parse_case_id(nodeid)["hook"]
        except ValueError:
            return None
        return hook if hook in {item.spec.name for item in self.state.specs} else None

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        """The case is over (setup, call and teardown): only now does its record count. A case that Ctrl-C
        cut off has a passed setup report and no other, and must not be listed as passed."""
        if nodeid in self.records:
            self._finished.add(nodeid)
        if nodeid in self._collected_ids:
            self.cases_run += 1

    # -- what the reports read -----------------------------------------------------------------

    def finished_records(self) -> List[CaseRecord]:
        """The records of the cases that finished, with the check of a case that never ran (no properties)
        taken from its test function's other cases, else from the function's name."""
        done = [rec for rec in self.records.values() if rec.id in self._finished]
        checks: Dict[str, str] = {}
        for rec in done:
            if rec.check:
                checks.setdefault(_function(rec.name), rec.check)
        for rec in done:
            if not rec.check:
                fn = _function(rec.name)
                rec.check = checks.get(fn) or (fn[len("test_"):] if fn.startswith("test_") else fn)
        return done


def _fill_from_case(rec: CaseRecord, case: Optional[CaseParams]) -> None:
    """The case's fields from its parameters, for a case skipped before the test set its properties."""
    if case is None:
        return
    rec.hook, rec.api, rec.variant, rec.world_size = case.hook, case.api, case.variant, case.world_size
    rec.model, rec.rule, rec.variant_field = case.model, case.rule, case.variant_field
    rec.nodes = getattr(case, "nodes", 1)


_STR_FIELDS = ("hook", "api", "check", "variant", "model", "rule")


def _apply_properties(rec: CaseRecord, props: Dict[str, Any]) -> None:
    """The case's fields and figures from its JUnit properties; a figure stays the float it was measured as."""
    for name in _STR_FIELDS:
        if props.get(name) is not None:
            setattr(rec, name, str(props[name]))
    if props.get("world_size") is not None:
        rec.world_size = int(props["world_size"])
    if props.get("nodes") is not None:
        rec.nodes = int(props["nodes"])
    measured = {key: int(props[key]) for key in REACH_PROPERTIES if props.get(key) is not None}
    if measured:
        rec.reach = {**(rec.reach or {}), **measured}
    if props.get(COST_PROPERTY) is not None:
        rec.cost = parse_property(props[COST_PROPERTY])
    for name in results.FIGURE_NAMES:
        if isinstance(props.get(name), (int, float)):
            rec.figures[name] = float(props[name])


def _function(name: str) -> str:
    return name.split("[", 1)[0]
