"""The suite's test modules, one per hook API: each test function is one call, ``conform.run_case(request, case)``.

The test functions of the checks the catalogue plans (:data:`conformance.catalogue.CATALOGUE`,
``catalogued=True``) are not written out: each module takes them from :func:`catalogued_tests`, so a new
check on every API needs no edit here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping

from conformance.apis.registry import HOOK_APIS

if TYPE_CHECKING:  # pragma: no cover
    import pytest

    from conformance.cases import CaseParams
    from conformance.controller.runner import Runner

__all__ = ["catalogued_tests"]


def _suite_test(name: str, doc: str) -> Callable[..., None]:
    def test(conform: Runner, request: pytest.FixtureRequest, case: CaseParams) -> None:
        conform.run_case(request, case)

    test.__name__ = test.__qualname__ = name
    test.__doc__ = doc
    return test


def catalogued_tests(module: Mapping[str, Any]) -> Dict[str, Callable[..., None]]:
    """The suite test functions whose checks the catalogue plans, by function name
    (:attr:`conformance.apis.HookApi.plans`), each with its entry's summary as its docstring, of the APIs whose
    other suite tests ``module`` (a suite module's globals) defines; a module puts them among its own with
    ``globals().update(catalogued_tests(globals()))``, before its combined cases (which run last)."""
    apis = [api for api in HOOK_APIS.values() if any(name in module for name in api.plans)]
    return {name: _suite_test(name, test.entry.summary + ".") for api in apis for name, test in api.plans.items()
            if test.entry is not None and name not in module}
