"""How a case ends other than passing: the hook failed it (:class:`ConformanceFailure`), or the run could not
run it (:class:`NotRun`). Raised by :class:`conformance.controller.runner.Runner` and the suite tests it runs."""

from __future__ import annotations

from typing import Sequence

import pytest

from conformance.protocol import Finding
from conformance.reports.report import exception_line

__all__ = ["ConformanceFailure", "NotRun", "pool_not_run"]


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
        why = f"{why} {exception_line(rest)}"
    return NotRun(f"its rank pool of world size {world_size} could not start: {why}"
                  f"{' (the whole error below)' if rest else ''}; the run's failure, not the hook's",
                  detail=text if rest else "")
