"""A hook's verdict as a value: its status (what programs read) and the words people read.

:func:`conformance.reports.report.hook_verdict` builds a :class:`Verdict` from a hook's
case outcomes; the terminal summary, the grid, the JSON (``verdict`` and ``status``) and
the Markdown read its :attr:`~Verdict.status`, never a prefix of its text. Its
:attr:`~Verdict.text` is the wording the reports print (``DOES NOT CONFORM (averaging,
parity)``, ``NOT RUN (reason)``, ``known failures; 1 known failure(s) now pass`` ...).

Plain data and standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple

__all__ = ["Status", "Verdict"]


class Status(str, enum.Enum):
    """A hook's status, as the JSON ``hooks[].status`` spells it (``results.schema.json`` allows exactly these).

    ``RUNNING`` is the status of a results file written while the run goes on; ``OTHER`` that of a hook
    no verdict was given for (no summary plugin in the session).
    """

    CONFORMS = "conforms"
    KNOWN_FAILURES = "known_failures"
    DOES_NOT_CONFORM = "does_not_conform"
    NOT_CHECKED_ACROSS_RANKS = "not_checked_across_ranks"
    NOT_RUN = "not_run"
    INTERRUPTED = "interrupted"
    RUNNING = "running"
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One hook's verdict.

    Attributes:
        status: the :class:`Status`.
        failed_checks: of ``DOES_NOT_CONFORM``: the checks of its failed cases (and what a case left
            behind, e.g. ``memory growth``), sorted.
        now_pass: known failures that passed (XPASS), counted in the text, never hidden.
        not_run_reason: of ``NOT_RUN``: why some of its cases could not run (the run's own failure, e.g.
            a rank pool that could not start), or ``None``.
        all_skipped: of ``NOT_RUN`` without a reason: every case of it was skipped (else none ran).
        cases_so_far: of ``RUNNING``: the hook's cases finished so far.
        known_failure_reasons: the reasons of its known failures (xfailed cases), sorted; the terminal
            lists them under the verdict.
    """

    status: Status
    failed_checks: Tuple[str, ...] = ()
    now_pass: int = 0
    not_run_reason: Optional[str] = None
    all_skipped: bool = False
    cases_so_far: int = 0
    known_failure_reasons: Tuple[str, ...] = ()

    @classmethod
    def running(cls, cases_so_far: int) -> "Verdict":
        """The verdict of a hook in a results file written while the run goes on."""
        return cls(Status.RUNNING, cases_so_far=cases_so_far)

    @property
    def text(self) -> str:
        """The verdict in words, as the terminal, the JSON ``verdict`` and the Markdown print it."""
        now_pass = f"; {self.now_pass} known failure(s) now pass" if self.now_pass else ""
        status = self.status
        if status is Status.DOES_NOT_CONFORM:
            return "DOES NOT CONFORM (" + ", ".join(self.failed_checks) + ")"
        if status is Status.INTERRUPTED:
            return "INTERRUPTED: no verdict" + now_pass
        if status is Status.NOT_RUN:
            if self.not_run_reason is not None:
                return f"NOT RUN ({self.not_run_reason})"
            return "NOT RUN: every case was skipped" if self.all_skipped else "not run"
        if status is Status.NOT_CHECKED_ACROSS_RANKS:
            return "NOT CHECKED ACROSS RANKS (every case ran at world size 1)"
        if status is Status.KNOWN_FAILURES:
            return "known failures" + now_pass
        if status is Status.CONFORMS:
            return "CONFORMS" + now_pass
        if status is Status.RUNNING:
            return f"RUNNING: {self.cases_so_far} case(s) so far"
        return ""

    def __str__(self) -> str:
        return self.text
