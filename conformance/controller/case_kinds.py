"""What the controller runs for one suite case, by its suite test's kind: a :class:`CasePlan`, planned by
:class:`CaseKinds` (one method per kind of :data:`conformance.catalogue.CASE_KINDS`) and carried out by the
:class:`~conformance.controller.runner.Runner`.

A suite test function is one call, ``conform.run_case(request, case)``
(:meth:`conformance.controller.runner.Runner.run_case`). The case carries its API and check (set by the API's
plan); the API's :class:`~conformance.apis.SuiteTest` for that check says which rank check to run, with which
parameters besides the case's own, and its kind:

* ``exact``: an exactness check; where no named cause explains a failure of a hook that declares no lossy
  contract, the attribution closes it with how to declare one
  (:data:`conformance.controller.attribution.DECLARE_LOSSY_HINT`);
* ``plain``: the check, its findings the failure;
* ``across_ranks``: as ``plain``, then each rank's per-step gradients against rank 0's;
* ``hard_inputs``: the named examples, then hypothesis's, a failure shrunk
  (:func:`conformance.controller.hard_inputs.check_case`);
* ``switches``: a combined case, run as ``exact`` (``plain`` for an API without lossy contracts), or skipped
  where the nightly's own combination is not needed
  (:meth:`~conformance.reports.hook_code.HookCodeLedger.combined_case_skip`);
* ``lossy_error``, ``lossy_loss``, ``lossy_determinism``: a lossy contract's checks (rank side:
  :mod:`conformance.ranks.checks.lossy`), the first two with their observed figure as a JUnit property, passing
  or failing, and a failure's closing line.

The kinds decide and return; they run nothing, so a case's path reads top to bottom: the test, the runner, the
plan, the runner's run, the pool.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import pytest

from conformance.apis import SuiteTest
from conformance.apis.registry import HOOK_APIS, suite_test
from conformance.apis.switches import named
from conformance.reports import report
from conformance.reports.results import ShortFigure

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.runner import Runner
    from conformance.protocol import CaseResult, Finding
    from conformance.spec import HookSpec

__all__ = ["CaseKinds", "CasePlan"]


@dataclasses.dataclass(frozen=True)
class CasePlan:
    """What the runner runs for one suite case (:meth:`~conformance.controller.runner.Runner.run_case`).

    Attributes:
        kind: the suite test's kind (:data:`conformance.catalogue.CASE_KINDS`).
        check: the suite's check name (``case.check``), for the case's JUnit properties and failure header.
        rank_check: the rank check's registered name (``"ddp.parity"``).
        params: keyword arguments for the rank check: the case's own, then the suite test's at the run's depth.
        exact: an exactness check (:attr:`~conformance.controller.attribution.CaseFacts.claims_exactness`).
        note: ``note(result, findings)`` closes the failure text (run on success too, with no findings).
    """

    kind: str
    check: str
    rank_check: str
    params: Dict[str, Any]
    exact: bool = False
    note: Optional[Callable[[CaseResult, List[Finding]], str]] = None

    @property
    def across_ranks(self) -> bool:
        """A case without findings compares each rank's per-step gradients with rank 0's."""
        return self.kind == "across_ranks"

    @property
    def hard_inputs(self) -> bool:
        """Run as hard-input examples (:func:`conformance.controller.hard_inputs.check_case`)."""
        return self.kind == "hard_inputs"


class CaseKinds:
    """Plans a suite case by its kind: :meth:`plan`, and one method per kind, each returning its
    :class:`CasePlan` (or skipping the case, ``pytest.skip``).

    Args:
        runner: the session's :class:`~conformance.controller.runner.Runner`; read only (its settings, loaded
            specs and hook-code ledger).
        request: the case's pytest request; a lossy note adds its figure to ``request.node.user_properties``.
    """

    def __init__(self, runner: Runner, request: pytest.FixtureRequest):
        self.runner = runner
        self.request = request

    def plan(self, case: CaseParams) -> CasePlan:
        """``case``'s plan, by the kind of its API's suite test for its check.

        Raises:
            KeyError: the case's API or check names no suite test.
            pytest.skip.Exception: a combined case the run does not need (:meth:`switches`).
        """
        test = suite_test(case)
        main = case.world_size == self.runner.settings.world_size  # the nightly's horizon at the main world size
        params = {**case.check_params(), **test.params_at(self.runner.settings.depth, main)}
        kind: Callable[[CaseParams, SuiteTest, Dict[str, Any]], CasePlan] = getattr(self, test.kind)
        return kind(case, test, params)

    def exact(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        return CasePlan("exact", case.check, test.rank_check_name, params, exact=True)

    def plain(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        return CasePlan("plain", case.check, test.rank_check_name, params)

    def across_ranks(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        return CasePlan("across_ranks", case.check, test.rank_check_name, params)

    def hard_inputs(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        return CasePlan("hard_inputs", case.check, test.rank_check_name, params)

    def switches(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        """A combined case (:mod:`conformance.apis.switches`): one whose spec names its switches always runs;
        the nightly's own combination only where the hook's code still has a branch its other cases never took
        (the ledger of what ran so far: a hook none of whose code is left untaken costs nothing). Either runs
        as its API's long run does: ``exact``, or ``plain`` on an API that takes no lossy contract (no hint on
        declaring one)."""
        ledger = self.runner.hook_code
        why = ledger.combined_case_skip(case.hook, named(self._spec(case)),
                                        getattr(self.runner.settings, "hook_coverage", True))
        if why is not None:
            pytest.skip(why)
        ledger.combined_started(case.hook)
        lossy = any(t.kind == "lossy_error" for t in HOOK_APIS[case.api].plans.values())
        return CasePlan("switches", case.check, test.rank_check_name, params, exact=lossy)

    def lossy_error(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        """``<api>.lossy_error`` on every rank; the largest ``max_rel_error`` of the ranks becomes the
        ``observed_rel_error`` property and the failure's closing line, with the declared bound."""
        def observed(result: CaseResult, found: List[Finding]) -> str:
            worst = max((o.value.figures for o in result.outcomes), key=lambda f: f["max_rel_error"])
            self.request.node.user_properties.append(("observed_rel_error", ShortFigure(worst["max_rel_error"])))
            return report.lossy_error_note(worst, self._spec(case).lossy.rel_error_bound)

        return CasePlan("lossy_error", case.check, f"{case.api}.lossy_error", self._lossy_params(case),
                        note=observed)

    def lossy_loss(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        """``<api>.lossy_loss``; the relative loss difference becomes the ``observed_loss_rel_diff`` property."""
        def observed(result: CaseResult, found: List[Finding]) -> str:
            figures = result.outcomes[0].value.figures
            self.request.node.user_properties.append(("observed_loss_rel_diff", ShortFigure(figures["rel_diff"])))
            contract = self._spec(case).lossy
            return report.lossy_loss_note(figures, contract.loss_steps, contract.loss_margin) if found else ""

        return CasePlan("lossy_loss", case.check, f"{case.api}.lossy_loss", self._lossy_params(case), note=observed)

    def lossy_determinism(self, case: CaseParams, test: SuiteTest, params: Dict[str, Any]) -> CasePlan:
        """``<api>.lossy_determinism``: two runs from the same seed, bitwise."""
        return CasePlan("lossy_determinism", case.check, f"{case.api}.lossy_determinism", self._lossy_params(case))

    def _spec(self, case: CaseParams) -> HookSpec:
        """The case's :class:`~conformance.spec.HookSpec`, as the runner loaded it."""
        return self.runner.specs[case.hook].spec

    @staticmethod
    def _lossy_params(case: CaseParams) -> Dict[str, Any]:
        return {case.variant_field: case.variant, "model": case.model}
