"""The controller side of lossy contracts: how every API's suite tests run a lossy case, or an exact one.

The suite test functions of each API (``conformance/suite/test_*.py``) call
these, so a lossy case reads the same whichever API produced it:

* :func:`error_case` runs ``<api>.lossy_error`` and reports the observed maximum
  relative error as the JUnit property ``observed_rel_error``, passing or failing;
* :func:`loss_case` runs ``<api>.lossy_loss`` and reports ``observed_loss_rel_diff``;
* :func:`determinism_case` runs ``<api>.lossy_determinism``;
* :func:`exact_case` runs an exactness check; where no named cause explains a
  failure of a hook with no contract, the attribution closes it with the hint on
  declaring one (:data:`conformance.controller.attribution.DECLARE_LOSSY_HINT`).

The rank-side checks are in :mod:`conformance.ranks.checks.lossy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from conformance.reports import report
from conformance.reports.results import ShortFigure

if TYPE_CHECKING:  # pragma: no cover
    import pytest
    from conformance.protocol import CaseResult, Finding

    from conformance.cases import CaseParams
    from conformance.controller.runner import Runner


def _spec(conform: Runner, case: CaseParams) -> Any:
    """The case's hook spec, as the runner (``conform``) loaded it."""
    return conform.specs[case.hook].spec


def _params(case: CaseParams, variant: str) -> Dict[str, Any]:
    return {variant: case.variant, "model": case.model}


def exact_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, check: str, rank_check: str,
               params: Dict[str, Any]) -> None:
    """An exactness check; a failure of a hook with no lossy contract that no named cause explains says how
    to declare one (the attribution decides: :data:`conformance.controller.attribution.DECLARE_LOSSY_HINT`)."""
    __tracebackhide__ = True
    conform.check(request, case, check, rank_check, params, exact=True)


def error_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, check: str, api: str,
               variant: str) -> None:
    """``<api>.lossy_error`` on every rank; the largest ``max_rel_error`` of the ranks becomes the
    ``observed_rel_error`` property and the failure's closing line, with the declared bound."""
    __tracebackhide__ = True

    def observed(result: CaseResult, found: List[Finding]) -> str:
        worst = max((o.value.figures for o in result.outcomes), key=lambda f: f["max_rel_error"])
        request.node.user_properties.append(("observed_rel_error", ShortFigure(worst["max_rel_error"])))
        return report.lossy_error_note(worst, _spec(conform, case).lossy.rel_error_bound)

    conform.check(request, case, check, f"{api}.lossy_error", _params(case, variant), note=observed)


def loss_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, check: str, api: str,
              variant: str) -> None:
    """``<api>.lossy_loss``; the relative loss difference becomes the ``observed_loss_rel_diff`` property."""
    __tracebackhide__ = True

    def observed(result: CaseResult, found: List[Finding]) -> str:
        figures = result.outcomes[0].value.figures
        request.node.user_properties.append(("observed_loss_rel_diff", ShortFigure(figures["rel_diff"])))
        contract = _spec(conform, case).lossy
        return report.lossy_loss_note(figures, contract.loss_steps, contract.loss_margin) if found else ""

    conform.check(request, case, check, f"{api}.lossy_loss", _params(case, variant), note=observed)


def determinism_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, check: str, api: str,
                     variant: str) -> None:
    """``<api>.lossy_determinism``: two runs from the same seed, bitwise."""
    __tracebackhide__ = True
    conform.check(request, case, check, f"{api}.lossy_determinism", _params(case, variant))
