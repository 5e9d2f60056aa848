"""The "hook conformance" section: each hook's verdict from its cases, the run's exit status, its closing lines.

:class:`Summary` is a pytest plugin object, registered by
:func:`conformance.controller.pytest_plugin.pytest_configure` as ``conformance-summary``. It
reads every case's report (its JUnit properties: hook, check, world size),
keeps per-hook counts in the session's
:class:`~conformance.controller.pytest_plugin.SessionState`, decides each hook's verdict
(:func:`conformance.reports.report.hook_verdict`), sets the exit status where pytest's
would mislead (a run stopped by ``-x`` is interrupted; a hook checked only at
world size 1, or a stale known-failures entry under ``--strict-known-failures``,
fails the run), and writes the terminal section; the text of the run's
closing lines is :mod:`conformance.reports.session_report`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import pytest

from conformance import exit_codes
from conformance.reports import report, results_plugin, session_report
from conformance.cases import parse_case_id

__all__ = ["Summary", "case_hook", "case_of"]


def case_of(item: pytest.Item) -> Optional[Any]:
    """The item's :class:`~conformance.cases.CaseParams`, or ``None`` for a test that is not a case."""
    return getattr(getattr(item, "callspec", None), "params", {}).get("case")


def case_hook(item: pytest.Item) -> Optional[str]:
    """The hook name of the item's case, or ``None``."""
    return getattr(case_of(item), "hook", None)


class Summary:
    """Collects per-hook outcomes, writes the "hook conformance" section, and sets the exit status.

    A hook's verdict is one of: ``DOES NOT CONFORM (checks)``; ``known failures``
    (each reason listed); ``CONFORMS``; ``NOT CHECKED ACROSS RANKS`` when every case
    of it that ran had world size 1 (a mean over one rank is the local gradient, so
    such a run proves nothing); ``not run``. Known failures that now pass (XPASS) are
    counted in the verdict and listed, never hidden behind "not run". An interrupted
    session (Ctrl-C, SIGTERM, or ``-x``/``--maxfail`` stopping before every case ran) gives
    no hook ``CONFORMS``: the section opens with ``INTERRUPTED after N of M cases``, and a
    hook without a failure is ``INTERRUPTED``; ``-x``/``--maxfail`` then exit 2, as Ctrl-C does.
    A run closes with what pytest's counts mean (:func:`conformance.reports.session_report.counts_lines`);
    a ``-k`` or ``-m`` that selected no case, with the hooks and checks there are.
    """

    def __init__(self, state: Any):
        self.state = state
        self.interrupted = False
        self.stopped_by = ""
        self.cases_run = 0
        self.cases_planned: Dict[Optional[str], int] = defaultdict(int)
        self._planned_ids: set = set()
        #: Suite tests with no case for the hooks under test (pytest's [NOTSET] placeholder) -> why.
        self.empty_tests: Dict[str, Tuple[str, bool]] = {}
        #: Names of the cases -k or -m deselected.
        self.deselected: List[str] = []
        #: World size -> the suite tests whose cases ran there (skipped ones excluded).
        self.tests_at: Dict[int, set] = defaultdict(set)

    def pytest_deselected(self, items: List[pytest.Item]) -> None:
        for item in items:
            if not item.get_closest_marker("conformance"):
                continue
            if item.name.endswith("[NOTSET]"):
                test = item.name[:-len("[NOTSET]")]
                self.empty_tests[test] = session_report.notset_cause(test, [i.spec for i in self.state.specs])
            else:
                self.deselected.append(item.name)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            if item.get_closest_marker("conformance"):  # the project's own tests load this plugin too
                self.cases_planned[case_hook(item)] += 1
                self._planned_ids.add(item.nodeid)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if nodeid in self._planned_ids:
            self.cases_run += 1

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.interrupted = True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        hook = props.get("hook")
        state = self.state
        if hook is None and report.when == "setup" and report.skipped:
            # Skipped (or an unrun known failure) before the test body set its properties:
            # the hook's name leads the case id.
            try:
                hook = parse_case_id(report.nodeid)["hook"]
            except ValueError:
                hook = None
            if hook not in {item.spec.name for item in state.specs}:
                hook = None
            elif not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2].replace("Skipped: ", "", 1)
                state.skip_reasons[hook][reason] = state.skip_reasons[hook].get(reason, 0) + 1
        if hook is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        strict_xpass = report.failed and str(report.longrepr).startswith("[XPASS(strict)]")
        if hasattr(report, "wasxfail") or strict_xpass:
            outcome = "xpassed" if report.passed or strict_xpass else "xfailed"
            if outcome == "xpassed":
                state.xpassed.append(report.nodeid)
            else:
                state.xfail_reasons[hook].add(report.wasxfail)
        else:
            outcome = report.outcome
            if report.failed:
                failed = state.per_hook_failed_checks[hook]
                failed.add(props.get("failed_check") or props.get("check", "?"))
                failed.update(label for key, label in report.user_properties if key == "leak")
            if "not_run" in props:
                state.not_run[hook].add(props["not_run"])
        if outcome != "skipped" and props.get("world_size") is not None:
            state.ran_at[hook].add(int(props["world_size"]))
            self.tests_at[int(props["world_size"])].add(report.nodeid.rsplit("::", 1)[-1].split("[", 1)[0])
        state.per_hook[hook][outcome] += 1

    def verdict(self, name: str) -> str:
        """The hook's verdict (:func:`conformance.reports.report.hook_verdict`); never ``CONFORMS`` in a run that
        stopped before every case ran (the issue's rule: an interrupted run never says CONFORMS)."""
        state = self.state
        return report.hook_verdict(state.per_hook.get(name) or {}, state.per_hook_failed_checks.get(name, ()),
                                   state.ran_at.get(name, ()), interrupted=self.interrupted,
                                   not_run=sorted(state.not_run.get(name, ())))

    def unchecked_hooks(self) -> List[str]:
        return [item.spec.name for item in self.state.specs
                if self.verdict(item.spec.name).startswith("NOT CHECKED ACROSS RANKS")]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stopped = session.shouldfail or session.shouldstop
        if stopped and self.cases_run < sum(self.cases_planned.values()):
            # -x / --maxfail stopped the run: the cases not run might fail, as after Ctrl-C, and it exits so.
            self.interrupted = True
            self.stopped_by = str(stopped)
            session.exitstatus = exit_codes.INTERRUPTED
            return
        state = self.state
        if state.not_run and exitstatus in (0, 1):
            # Some hook could not be checked: the run did not do its job, whatever the others gave.
            session.exitstatus = exit_codes.RUN_ERROR
            return
        if exitstatus != 0:
            return
        if self.unchecked_hooks() or (state.settings.strict_known_failures and state.unused_entries):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        state = self.state
        tr = terminalreporter
        if not self.cases_planned and self.deselected:
            tr.section("no case matched")
            for line in session_report.no_case_lines(tr.config.option.keyword, tr.config.option.markexpr,
                                                     self.deselected, [i.spec.name for i in state.specs],
                                                     len(self.empty_tests)):
                tr.write_line(line, yellow=True)
            return
        if state.per_hook or (self.interrupted and self.cases_planned):
            tr.section("hook conformance")
        if self.interrupted and self.cases_planned:
            why = f" ({self.stopped_by})" if self.stopped_by else ""
            tr.write_line(f"INTERRUPTED after {self.cases_run} of {sum(self.cases_planned.values())} cases{why}: "
                          "a hook without a failure gets no verdict, since not every case ran", red=True)
        for item in state.specs:
            name = item.spec.name
            counts = state.per_hook.get(name)
            planned = f" of {self.cases_planned[name]}" if self.interrupted else ""
            if not counts:
                if self.interrupted and self.cases_planned.get(name):
                    tr.write_line(f"{name:<28} {self.verdict(name)}  [0{planned} cases]")
                continue
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            tr.write_line(f"{name:<28} {self.verdict(name)}  [{sum(counts.values())}{planned} cases: {detail}]")
            for reason in sorted(state.xfail_reasons.get(name, ())):
                tr.write_line(f"{'':<28}   expected: {reason}")
            if not (counts.get("passed") or counts.get("failed") or counts.get("xfailed")):
                for reason, n in sorted(state.skip_reasons.get(name, {}).items()):
                    tr.write_line(f"{'':<28}   skipped ({n}): {reason}")
            for line in results_plugin.hook_matrix_lines(tr.config, name, self.verdict(name), indent=" " * 4):
                tr.write_line(line)
        if state.xpassed:
            tr.section("known failures that now pass")
            for nodeid in state.xpassed:
                tr.write_line(f"XPASS {nodeid}: remove or narrow its entry in the known-failures file")
        unchecked = self.unchecked_hooks()
        if unchecked:
            tr.write_line(f"exit status 1: {', '.join(unchecked)} ran only at world size 1, where a mean over one "
                          "rank is the local gradient; run with --world-size 2 or more (or --extra-world-size 3)",
                          red=True)
        if state.settings.strict_known_failures and state.unused_entries:
            tr.section("known-failures entries that match no test (--strict-known-failures)")
            for entry in state.unused_entries:
                tr.write_line(f"{entry.source}: test = {entry.test!r} ({entry.conditions()}): update or remove it")
        runner = state.runner
        if runner is not None and getattr(runner, "restarts", 0):
            tr.write_line(f"rank pools restarted {runner.restarts} time(s) after hung or broken cases")
        if state.not_run and not self.interrupted:
            tr.write_line(f"exit status {exit_codes.RUN_ERROR}: the run could not check every hook (NOT RUN above: "
                          "its rank pools could not start); no hook is blamed for that. Fix what the reason says "
                          "and run again", red=True)
        if state.settings.listen is not None:  # connections refused for want of the shared secret
            from conformance.controller.remote import summary_lines

            for line in summary_lines():
                tr.write_line(line, yellow=True)
        if state.per_hook:
            totals, xfailed_builtin = session_report.split_counts(
                state.per_hook, [i.spec.name for i in state.specs if i.origin == "built-in"])
            env = state.book.env
            tr.section("what the counts mean")
            for line in session_report.counts_lines(
                    totals, xfailed_builtin, self.empty_tests, len(self.deselected), self.tests_at,
                    state.settings.world_sizes, f"torch {env.torch_version}, "
                    f"{'CUDA' if env.cuda_build else 'CPU'} build, {env.backend}, {env.device}"):
                tr.write_line(line)
