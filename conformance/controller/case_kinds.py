"""How the controller runs one suite case, by its suite test's kind: what every suite test function calls.

A suite test function is one call, ``conform.run_case(request, case)``
(:meth:`conformance.controller.runner.Runner.run_case`). The case carries its
API and check (set by the API's plan); the API's :class:`~conformance.apis.SuiteTest`
for that check says which rank check to run, with which parameters besides the
case's own, and how (:data:`conformance.catalogue.CASE_KINDS`):

* ``exact``: an exactness check; a failure that no named cause explains ends with
  how to declare a lossy contract (:func:`conformance.controller.lossy_cases.exact_case`);
* ``plain``: the check, its findings the failure;
* ``across_ranks``: as ``plain``, then each rank's per-step gradients against rank 0's;
* ``hard_inputs``: the named examples, then hypothesis's, a failure shrunk
  (:func:`conformance.controller.hard_inputs.check_case`);
* ``switches``: a combined case, run as ``exact`` (``plain`` for an API without lossy contracts), or skipped
  where the nightly's own combination is not needed (:meth:`~conformance.reports.hook_code.HookCodeLedger.combined_case_skip`);
* ``lossy_error``, ``lossy_loss``, ``lossy_determinism``: a lossy contract's checks, their
  observed figures as JUnit properties (:mod:`conformance.controller.lossy_cases`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict

import pytest

from conformance.apis import SuiteTest
from conformance.apis.registry import HOOK_APIS, suite_test
from conformance.apis.switches import named
from conformance.controller import lossy_cases
from conformance.controller.hard_inputs import check_case

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.runner import Runner

__all__ = ["KINDS", "run_case"]


def _exact(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
           params: Dict[str, Any]) -> None:
    __tracebackhide__ = True
    lossy_cases.exact_case(conform, request, case, case.check, test.rank_check_name, params)


def _plain(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
           params: Dict[str, Any]) -> None:
    __tracebackhide__ = True
    conform.check(request, case, case.check, test.rank_check_name, params)


def _across_ranks(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
                  params: Dict[str, Any]) -> None:
    __tracebackhide__ = True
    conform.check(request, case, case.check, test.rank_check_name, params, across_ranks=True)


def _hard_inputs(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
                 params: Dict[str, Any]) -> None:
    __tracebackhide__ = True
    check_case(conform, request, case, case.check, test.rank_check_name, params)


def _switches(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
              params: Dict[str, Any]) -> None:
    """A combined case (:mod:`conformance.apis.switches`): one whose spec names its switches always runs; the
    nightly's own combination only where the hook's code still has a branch its other cases never took (the
    ledger of what ran so far: a hook none of whose code is left untaken costs nothing). Either runs as its
    API's long run does."""
    __tracebackhide__ = True
    spec = conform.specs[case.hook].spec
    why = conform.hook_code.combined_case_skip(case.hook, named(spec), getattr(conform.settings, "hook_coverage", True))
    if why is not None:
        pytest.skip(why)
    conform.hook_code.combined_started(case.hook)
    if any(t.kind == "lossy_error" for t in HOOK_APIS[case.api].plans.values()):
        _exact(conform, request, case, test, params)
    else:  # an API that takes no lossy contract: no hint on declaring one
        _plain(conform, request, case, test, params)


def _lossy(run: Callable[..., None]) -> Callable[..., None]:
    def kind(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, test: SuiteTest,
             params: Dict[str, Any]) -> None:
        __tracebackhide__ = True
        run(conform, request, case, case.check, case.api, case.variant_field)

    return kind


#: How each kind of case runs (one per :data:`conformance.catalogue.CASE_KINDS`): ``kind(conform, request, case,
#: test, params)``.
KINDS: Dict[str, Callable[..., None]] = {
    "exact": _exact, "plain": _plain, "across_ranks": _across_ranks, "hard_inputs": _hard_inputs,
    "switches": _switches,
    "lossy_error": _lossy(lossy_cases.error_case), "lossy_loss": _lossy(lossy_cases.loss_case),
    "lossy_determinism": _lossy(lossy_cases.determinism_case),
}


def run_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams) -> None:
    """Run ``case`` (a :class:`~conformance.cases.CaseParams`) as its suite test says, through ``conform``
    (the session's :class:`~conformance.controller.runner.Runner`).

    Raises:
        ConformanceFailure: the hook does not conform (or a rank raised, hung or died).
        KeyError: the case's API or check names no suite test.
    """
    __tracebackhide__ = True
    test = suite_test(case)
    settings = conform.settings
    main = case.world_size == settings.world_size  # the nightly's horizon at the main world size only
    KINDS[test.kind](conform, request, case, test, {**case.check_params(), **test.params_at(settings.depth, main)})
