"""The "hook conformance" section: each hook's verdict from its cases, the run's exit status, its closing lines.

:class:`Summary` is a pytest plugin object, registered by
:func:`conformance.controller.pytest_plugin.pytest_configure` as ``conformance-summary``. It
reads what the session's :class:`~conformance.reports.bookkeeper.Bookkeeper` made of every
case's reports (per-hook counts, failed checks, reasons, world sizes), decides each hook's
verdict (:func:`conformance.reports.report.hook_verdict`, a
:class:`~conformance.reports.verdict.Verdict`), sets the exit status where pytest's
would mislead (a run stopped by ``-x`` is interrupted; a hook checked only at
world size 1, or a stale known-failures entry under ``--strict-known-failures``,
fails the run), and writes the terminal section; the text of the run's
closing lines is :mod:`conformance.reports.session_report`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

import pytest

from conformance import exit_codes
from conformance.reports import report, results, results_plugin, session_report
from conformance.reports.bookkeeper import Bookkeeper
from conformance.reports.hook_code import hook_code_of
from conformance.reports.cost import hook_cost
from conformance.reports.reach import hook_reach, not_checked_lines, reach_context
from conformance.reports.verdict import Status, Verdict

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.pytest_plugin import SessionState

__all__ = ["Summary"]


class Summary:
    """Gives each hook its verdict, writes the "hook conformance" section, and sets the exit status.

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

    Args:
        state: the session's :class:`~conformance.controller.pytest_plugin.SessionState`.
        keeper: the session's :class:`~conformance.reports.bookkeeper.Bookkeeper`, which classified every case.
    """

    def __init__(self, state: SessionState, keeper: Bookkeeper):
        self.state = state
        self.keeper = keeper
        self.interrupted = False
        self.stopped_by = ""

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.interrupted = True

    def verdict(self, name: str) -> Verdict:
        """The hook's verdict (:func:`conformance.reports.report.hook_verdict`); never ``CONFORMS`` in a run that
        stopped before every case ran (the issue's rule: an interrupted run never says CONFORMS). A hook none of
        whose cases was selected was not interrupted: it had nothing to run."""
        tally = self.keeper.tally(name)
        interrupted = self.interrupted and self.keeper.planned.get(name, 0) > 0
        return report.hook_verdict(tally.counts, tally.failed_checks, tally.ran_at, interrupted=interrupted,
                                   not_run=sorted(tally.not_run), known_failure_reasons=tally.known_failure_reasons)

    def unchecked_hooks(self) -> List[str]:
        return [item.spec.name for item in self.state.specs
                if self.verdict(item.spec.name).status is Status.NOT_CHECKED_ACROSS_RANKS]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stopped = session.shouldfail or session.shouldstop
        keeper = self.keeper
        if stopped and keeper.cases_run < sum(keeper.planned.values()):
            # -x / --maxfail stopped the run: the cases not run might fail, as after Ctrl-C, and it exits so.
            self.interrupted = True
            self.stopped_by = str(stopped)
            session.exitstatus = exit_codes.INTERRUPTED
            return
        state = self.state
        not_run = any(tally.not_run for tally in keeper.hooks.values())
        if not_run and exitstatus in (0, 1):
            # Some hook could not be checked: the run did not do its job, whatever the others gave.
            session.exitstatus = exit_codes.RUN_ERROR
            return
        if exitstatus != 0:
            return
        if self.unchecked_hooks() or (state.settings.strict_known_failures and state.unused_entries):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _reach_lines(self, tr: pytest.TerminalReporter, records: List[Any], name: str, ran: bool) -> None:
        """Under a hook's verdict, after where it fails and why: what of its plan was not checked here, and which
        of its own code ran, each never-taken branch with its source line."""
        if ran:
            for line in not_checked_lines(records, name):
                tr.write_line(f"{'':<28}   {line}")
        cost = hook_cost(records, name)
        if cost is not None:
            tr.write_line(f"{'':<28}   {cost.text}")
        code = hook_code_of(self.state, name)
        if code is not None:
            tr.write_line(f"{'':<28}   {code.text}")
            for line in code.detail_lines():
                tr.write_line(f"{'':<28}     {line}")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        state, keeper = self.state, self.keeper
        tr = terminalreporter
        planned = keeper.planned
        if not planned and keeper.deselected:
            tr.section("no case matched")
            for line in session_report.no_case_lines(tr.config.option.keyword, tr.config.option.markexpr,
                                                     keeper.deselected, [i.spec.name for i in state.specs],
                                                     len(keeper.empty_tests)):
                tr.write_line(line, yellow=True)
            return
        if keeper.hooks or (self.interrupted and planned):
            tr.section("hook conformance")
        if self.interrupted and planned:
            why = f" ({self.stopped_by})" if self.stopped_by else ""
            tr.write_line(f"INTERRUPTED after {keeper.cases_run} of {sum(planned.values())} cases{why}: "
                          "a hook without a failure gets no verdict, since not every case ran", red=True)
        records = keeper.finished_records()  # once: each hook's cause line reads them
        for item in state.specs:
            name = item.spec.name
            of_planned = f" of {planned[name]}" if self.interrupted else ""
            if name not in keeper.hooks:
                if self.interrupted and planned.get(name):
                    tr.write_line(f"{name:<28} {self.verdict(name)}  [0{of_planned} cases]")
                continue
            tally, verdict = keeper.hooks[name], self.verdict(name)
            counts = tally.counts
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            reach = hook_reach(records, name, *reach_context(state))
            detail += f"; {reach.text}" if reach is not None and reach.text else ""
            detail += f"; params {item.spec.param_dtype_name}" if item.spec.param_dtype is not None else ""
            detail += f"; native {' and '.join(item.spec.natives())}" if item.spec.native_modes is not None else ""
            detail += f"; sampled: {', '.join(item.spec.sample_checks)}" if item.spec.sample_checks else ""
            tr.write_line(f"{name:<28} {verdict}  [{sum(counts.values())}{of_planned} cases: {detail}]")
            rerun = session_report.crash_rerun_verdict_note(getattr(state.runner, "crash_reruns", ()), name)
            if rerun:
                tr.write_line(f"{'':<28}   {rerun}", yellow=True)
            subset = session_report.selection_note(sum(counts.values()), keeper.deselected_of.get(name, 0),
                                                   tr.config.option.keyword, tr.config.option.markexpr)
            if subset:  # a -k subset's verdict is not the hook's
                tr.write_line(f"{'':<28}   {subset}", yellow=True)
            for reason in verdict.known_failure_reasons:
                tr.write_line(f"{'':<28}   expected: {reason}")
            if not (counts.get("passed") or counts.get("failed") or counts.get("xfailed")):
                for reason, n in sorted(tally.skip_reasons.items()):
                    tr.write_line(f"{'':<28}   skipped ({n}): {reason}")
            for line in results_plugin.hook_matrix_lines(tr.config, name, verdict, indent=" " * 4):
                tr.write_line(line)
            failed = [rec for rec in records if rec.hook == name and rec.failing]
            causes = results.hook_causes(failed, name)
            cause = results.cause_line(causes, len(failed), results.hook_families(failed, name))
            if cause:  # under the grid: where it fails, then why, then what to change
                tr.write_line(f"    {cause}")
                fix = results.hook_fixes(failed, name).get(causes[0][0])
                if fix:
                    tr.write_line(f"      fix: {fix}")
            self._reach_lines(tr, records, name, bool(counts.get("passed") or counts.get("failed")
                                                      or counts.get("xfailed")))
        if keeper.xpassed:
            tr.section("known failures that now pass")
            for nodeid in keeper.xpassed:
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
        for line in session_report.crash_rerun_lines(getattr(runner, "crash_reruns", ())):
            tr.write_line(line, yellow=True)
        if any(tally.not_run for tally in keeper.hooks.values()) and not self.interrupted:
            tr.write_line(f"exit status {exit_codes.RUN_ERROR}: the run could not check every hook (NOT RUN above: "
                          "rank pools that could not start, or cases that even PyTorch's own default hook cannot run here); no "
                          "hook is blamed for that. Fix what the reason says "
                          "and run again", red=True)
        for line in getattr(state, "listener_lines", ()):  # connections the --listen listener refused
            tr.write_line(line, yellow=True)
        if keeper.hooks:
            totals, xfailed_builtin = session_report.split_counts(
                {name: tally.counts for name, tally in keeper.hooks.items()},
                [i.spec.name for i in state.specs if i.origin == "built-in"])
            env = state.book.env
            tr.section("what the counts mean")
            for line in session_report.counts_lines(
                    totals, xfailed_builtin, keeper.empty_tests, len(keeper.deselected), keeper.tests_at,
                    state.settings.world_sizes, f"torch {env.torch_version}, "
                    f"{'CUDA' if env.cuda_build else 'CPU'} build, {env.backend}, {env.device}"):
                tr.write_line(line)
