"""A case's :class:`~conformance.reports.results.CaseRecord` from pytest's reports of it: fields, properties, outcome.

:class:`conformance.reports.results_plugin.ResultsRecorder` calls these for every
``TestReport`` (setup, call, teardown) of a conformance case.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from conformance.reports import results
from conformance.reports.results import FAILING, CaseRecord, parse_figure

__all__ = ["apply_outcome", "apply_properties", "fill_from_case", "skip_reason"]


def fill_from_case(rec: CaseRecord, case: Any) -> None:
    """The case's fields from its parameters, for a case skipped before the test set its properties."""
    if case is None:
        return
    rec.hook, rec.api, rec.variant, rec.world_size = case.hook, case.api, case.variant, case.world_size
    rec.model, rec.rule, rec.variant_field = case.model, case.rule, case.variant_field


_STR_FIELDS = ("hook", "api", "check", "variant", "model", "rule")


def apply_properties(rec: CaseRecord, props: Dict[str, Any]) -> None:
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


def apply_outcome(rec: CaseRecord, report: pytest.TestReport) -> None:
    """The case's outcome after this phase's report (setup, call, teardown), pytest's rules for xfail."""
    wasxfail = getattr(report, "wasxfail", None)
    if report.when == "setup":
        if report.skipped:
            if wasxfail is not None:
                rec.outcome, rec.known_failure_reason = "xfailed", wasxfail
            else:
                rec.outcome, rec.skip_reason = "skipped", skip_reason(report)
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
                rec.skip_reason = skip_reason(report)
    elif report.failed and rec.outcome not in FAILING:  # teardown
        rec.outcome = "error"


def skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).replace("Skipped: ", "", 1)
    return str(report.longrepr)
