"""How a case ends other than passing, and how a failed case is told.

A case ends as the hook's failure (:class:`ConformanceFailure`) or as one the run could not run (:class:`NotRun`,
:func:`pool_not_run`); both are raised by :class:`conformance.controller.runner.Runner` and the suite tests it runs.
A :class:`ConformanceFailure`'s message tells the case: every rank's problem with the case's re-run in fresh ranks
(:func:`rank_problems`), then, under ``--write-reproducers``, where the case's reproducer is and how to run it
(:func:`reproducer_note`), then the command that re-runs just that case (:func:`rerun_command`).
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import pytest

from conformance.controller.attribution import Replay, Run
from conformance.controller.cli import command_words, python_words
from conformance.shared.spec_loading import pythonpath_to_rerun
from conformance.protocol import Case, CaseResult, Finding
from conformance.reports import report
from conformance.reproducers import writer

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.shared.spec_loading import LoadedSpec

__all__ = ["ConformanceFailure", "NotRun", "pool_not_run", "rank_problems", "reproducer_command", "reproducer_note",
           "rerun_command"]


class ConformanceFailure(AssertionError):
    """A hook failed a check; the message is the whole report of that case.

    Attributes:
        findings: the findings behind it; when a rank raised, hung or died, only those of what the
            hook left behind in its process (kinds ``"process_state"``, ``"memory"``).
        rank_problems: a rank raised, hung or died.
    """

    def __init__(self, message: str, findings: Sequence[Finding] = (), rank_problems: bool = False):
        super().__init__(message)
        self.findings = tuple(findings)
        self.rank_problems = rank_problems


class NotRun(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A case that the run's own infrastructure could not run (a rank pool that could not start, ranks that
    never connected). Reported as a skip whose reason starts ``NOT RUN:``; the plugin marks the case
    (JUnit property ``not_run``), the hook's verdict reads ``NOT RUN (reason)`` unless a case of it
    failed, and the run exits :data:`conformance.exit_codes.RUN_ERROR`. Never the hook's failure.

    ``reason`` is one line; ``detail`` (a rank's traceback, say) follows it in the skip message, which
    JUnit XML (``<skipped message=...>``) and the results file (``skip_reason``) keep whole.
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"NOT RUN: {reason}" + (f"\n{detail.rstrip()}" if detail.strip() else ""), pytrace=False)
        self.reason = reason


def pool_not_run(error: str, world_size: int) -> NotRun:
    """The :class:`NotRun` of a case whose rank pool of ``world_size`` could not start with ``error`` (a
    ``PoolStartError``'s text: a first line, then perhaps a rank's traceback).

    The reason is one line: the error's first line, completed with the exception its traceback ends with
    where that line only leads into it (``rank 0 could not join the process group: RuntimeError: ...``).
    The whole error follows it in the skip message."""
    text = error.strip()
    lines = text.splitlines() or ["?"]
    why = lines[0].split(f"pool of world size {world_size}: ", 1)[-1].rstrip()
    rest = "\n".join(lines[1:]).strip()
    if rest and why.endswith(":"):
        why = f"{why} {report.exception_line(rest)}"
    return NotRun(f"its rank pool of world size {world_size} could not start: {why}"
                  f"{' (the whole error below)' if rest else ''}; the run's failure, not the hook's",
                  detail=text if rest else "")


def rank_problems(result: CaseResult, runs: Sequence[Run], reruns: Sequence[Any]) -> str:
    """What went wrong per rank in the case's run ``result`` (``""``: every rank finished,
    :func:`conformance.reports.report.rank_problems`), then how its re-run in fresh ranks went, if ``runs`` hold
    one (``reruns[-1]`` is its :class:`~conformance.controller.replays.CrashRerun`), then what the hook left in
    its ranks."""
    problems = report.rank_problems(result)
    if not problems:
        return ""
    rerun = next((r for r in runs if r.replay is Replay.CRASH_RERUN), None)
    if rerun is not None and rerun.result is None:
        why = f": {rerun.not_started}" if rerun.not_started else ""
        problems += f"\n(a rank died, and the case could not run again in fresh ranks{why})"
    elif rerun is not None:
        problems += (f"\n(the case was run twice, the second time in fresh ranks of its own; this is the "
                     f"second run's failure; the first: {reruns[-1].death})")
    leaks = result.leak_findings()
    return problems + ("\n" + report.findings_text(leaks) if leaks else "")


def rerun_command(settings: Settings, item: Optional[LoadedSpec], test_name: str,
                  world_size: Optional[int] = None) -> str:
    """The shell command that re-runs just ``test_name`` (of the hook whose loaded spec is ``item``, ``None``: no
    hook) from a fresh shell in this working directory.

    ``PYTHONPATH=...`` first where the session imported modules from
    ``PYTHONPATH`` entries other than the working directory (a hook package
    outside it, :func:`~conformance.shared.spec_loading.pythonpath_to_rerun`); then
    ``conform``, or ``/path/to/python -m conformance`` where the ``conform`` on
    ``PATH`` is not this interpreter's (:func:`~conformance.controller.cli.command_words`:
    a fresh shell may not have the venv on ``PATH``); then the hook's ``--hook``
    target (a built-in or entry-point hook needs none), the machine settings of
    the case's pool and a hypothesis seed where one was given
    (:meth:`Settings.rerun_args`, paths absolute), ``-k test_name``.
    """
    args = command_words()
    if item is not None and item.origin == "--hook":
        args += ["--hook", item.target]
    args += settings.rerun_args(world_size)
    args += ["-k", test_name]
    command = " ".join(shlex.quote(a) for a in args)
    path = pythonpath_to_rerun()
    if path:
        # Quote the value only: a quoted "NAME=value" word is a command, not an assignment.
        command = f"PYTHONPATH={shlex.quote(os.pathsep.join(path))} {command}"
    return command


def reproducer_command(path: str) -> str:
    """The shell command that runs a reproducer from a fresh shell in this working directory: ``PYTHONPATH=...``
    first where the session imported modules from ``PYTHONPATH`` entries (as :func:`rerun_command`), then this
    interpreter (``python`` where the ``python`` on ``PATH`` is this venv's, :func:`python_words`) and the file."""
    command = " ".join(shlex.quote(w) for w in [*python_words(), path])
    extra = pythonpath_to_rerun()
    return f"PYTHONPATH={shlex.quote(os.pathsep.join(extra))} {command}" if extra else command


def reproducer_note(settings: Settings, item: Optional[LoadedSpec], case: Case, world_size: int,
                    findings: Sequence[Finding], describe: Dict[str, Any]) -> str:
    """Under ``--write-reproducers DIR``, write the failed ``case``'s standalone reproducer
    (:mod:`conformance.reproducers`; ``item``: the hook's loaded spec) and return the failure's lines that say where
    it is and how to run it (:func:`reproducer_command`, and why it needs the suite where it does), or why the case
    has none; ``""`` without the option (or for a case of no hook). Only a failed case is given one: callers pass
    its findings (none for a rank that raised, hung or died)."""
    directory = getattr(settings, "reproducers_dir", None)
    if not directory or item is None:
        return ""
    test_name, hook = case.case_id, case.hook.name if case.hook is not None else None
    path = writer.reproducer_path(directory, test_name)
    try:
        source = writer.reproducer_source(item.spec, item.target, case.check, case.params, world_size, test_name,
                                          findings, report.header(hook, describe, world_size),
                                          rerun_command(settings, item, test_name, world_size), path,
                                          nodes=int(describe.get("nodes", 1)),
                                          backend=settings.placement(world_size)[0])
        writer.write_reproducer(path, source)
    except writer.NoReproducer as exc:
        return f"No standalone reproducer: {exc}"
    except OSError as exc:
        return f"No standalone reproducer: writing {path} failed: {exc}"
    needs = writer.needs_the_suite(item.spec, item.target)
    return (f"Standalone reproducer: {path}\n"
            f"  {reproducer_command(path)}   (from this directory; it starts its {world_size} ranks; "
            f"exit 1 reproduced, 0 not, 2 could not run)"
            + (f"\n  It needs commhook-conformance installed: {needs}" if needs else ""))
