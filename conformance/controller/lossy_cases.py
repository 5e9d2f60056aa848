"""The controller side of lossy contracts: how every API's suite tests run a lossy case, or an exact one.

The suite test functions of each API (``conformance/suite/test_*.py``) call
these, so a lossy case reads the same whichever API produced it:

* :func:`error_case` runs ``<api>.lossy_error`` and reports the observed maximum
  relative error as the JUnit property ``observed_rel_error``, passing or failing;
* :func:`loss_case` runs ``<api>.lossy_loss`` and reports ``observed_loss_rel_diff``;
* :func:`determinism_case` runs ``<api>.lossy_determinism``;
* :func:`exact_case` runs an exactness check and, where no named cause explains a
  failure, closes it with the hint on declaring a contract
  (:func:`lossy_hint`).

The rank-side checks are in :mod:`conformance.ranks.checks.lossy`.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

from conformance.protocol import Finding, FindingKind
from conformance.reports import report
from conformance.reports.results import ShortFigure

#: Shown under a failed exactness check of a hook that declares no lossy contract, where no named exact
#: cause (:func:`conformance.reports.report.explained`) explains the difference (:func:`lossy_hint`).
DECLARE_LOSSY_HINT = (
    "If this hook is lossy by design (compression, quantization, low-rank, a reduction more accurate than "
    "native), declare what it promises instead of exactness: "
    "HookSpec(..., lossy=LossyContract(rel_error_bound=..., loss_margin=...)); "
    "the suite then checks the declared error bound against the exact float64 mean, no NaN/Inf introduced, "
    "the training-loss margin and determinism, plus the API's structural rules, instead of bitwise parity"
)


def lossy_hint(spec: Any, found: Sequence[Finding]) -> str:
    """The closing note of a failed exactness check: :data:`DECLARE_LOSSY_HINT` where it fits, else ``""``.

    It fits a hook with no contract yet whose difference nothing else explains:
    not a hook that never communicated (a finding of kind ``"local_gradient"``),
    not a hook that broke its API's contract (kind ``"contract"``: a Tensor returned
    where DDP needs a Future, a gradient left in the wrong dtype; a bug whatever
    the design),
    not a failure made only of what the hook left behind (``"process_state"``, ``"memory"``),
    and not one whose result a named exact cause reproduces bit for bit
    (:func:`conformance.reports.report.explained`: a wrong divisor, a stale step, a
    neighbour's shard are bugs, not a lossy design).
    """
    found = [f for f in found if f.kind not in (FindingKind.PROCESS_STATE, FindingKind.MEMORY)]  # leaks, not a design
    fits = (spec.lossy is None and bool(found)
            and not any(f.kind in (FindingKind.LOCAL_GRADIENT, FindingKind.CONTRACT) for f in found)
            and not report.explained(found))
    return "  " + DECLARE_LOSSY_HINT if fits else ""


def _spec(conform: Any, case: Any) -> Any:
    """The case's hook spec, as the runner (``conform``) loaded it."""
    return conform.specs[case.hook].spec


def _params(case: Any, variant: str) -> Dict[str, Any]:
    return {variant: case.variant, "model": case.model}


def exact_case(conform: Any, request: Any, case: Any, check: str, rank_check: str, params: Dict[str, Any]) -> None:
    """An exactness check; a failure of a hook with no lossy contract that no named cause explains says how
    to declare one."""
    __tracebackhide__ = True
    conform.check(request, case, check, rank_check, params, note=lambda result, found: lossy_hint(
        _spec(conform, case), found) if found else "")


def error_case(conform: Any, request: Any, case: Any, check: str, api: str, variant: str) -> None:
    """``<api>.lossy_error`` on every rank; the largest ``max_rel_error`` of the ranks becomes the
    ``observed_rel_error`` property and the failure's closing line, with the declared bound."""
    __tracebackhide__ = True

    def observed(result: Any, found: Any) -> str:
        worst = max((o.value.figures for o in result.outcomes), key=lambda f: f["max_rel_error"])
        request.node.user_properties.append(("observed_rel_error", ShortFigure(worst["max_rel_error"])))
        return report.lossy_error_note(worst, _spec(conform, case).lossy.rel_error_bound)

    conform.check(request, case, check, f"{api}.lossy_error", _params(case, variant), note=observed)


def loss_case(conform: Any, request: Any, case: Any, check: str, api: str, variant: str) -> None:
    """``<api>.lossy_loss``; the relative loss difference becomes the ``observed_loss_rel_diff`` property."""
    __tracebackhide__ = True

    def observed(result: Any, found: Any) -> str:
        figures = result.outcomes[0].value.figures
        request.node.user_properties.append(("observed_loss_rel_diff", ShortFigure(figures["rel_diff"])))
        contract = _spec(conform, case).lossy
        return report.lossy_loss_note(figures, contract.loss_steps, contract.loss_margin) if found else ""

    conform.check(request, case, check, f"{api}.lossy_loss", _params(case, variant), note=observed)


def determinism_case(conform: Any, request: Any, case: Any, check: str, api: str, variant: str) -> None:
    """``<api>.lossy_determinism``: two runs from the same seed, bitwise."""
    __tracebackhide__ = True
    conform.check(request, case, check, f"{api}.lossy_determinism", _params(case, variant))
