"""How a case ends other than passing: the hook failed it (:class:`ConformanceFailure`), or the run could not
run it (:class:`NotRun`). Raised by :class:`conformance.controller.runner.Runner` and the suite tests it runs."""

from __future__ import annotations

from typing import Sequence

import pytest

from conformance.protocol import Finding

__all__ = ["ConformanceFailure", "NotRun"]


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
    """

    def __init__(self, reason: str):
        super().__init__(f"NOT RUN: {reason}", pytrace=False)
        self.reason = reason
