"""The hook APIs the suite knows: :data:`HOOK_APIS`, built from the API plan modules in :data:`ADAPTERS`.

Each API's plan module (``conformance/apis/<api>/plan.py``) exports ``APIS``, its
:class:`~conformance.apis.HookApi` entries. ``HookSpec`` validation, the
built-in hook targets, the rank checks (:func:`conformance.ranks.checks.get_rank_check`),
the case types and the suite's parametrization all read this registry, the one
place outside an API's folder that names its modules by name. (What the controller's
side uses of an API's folder, its built-in hooks, default hook and standalone part, it
imports through :mod:`conformance.apis.controller_side`, where the linter sees it.)
docs/architecture.md's "Adding a hook API" lists the files a new API touches.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from conformance.apis import HookApi, SuiteTest

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.settings import Settings

__all__ = ["ADAPTERS", "HOOK_APIS", "api_of_test", "planned_cases", "suite_test"]

#: The API plan modules, in the order the report lists their APIs.
ADAPTERS: Tuple[str, ...] = (
    "conformance.apis.fsdp.plan",
    "conformance.apis.ddp.plan",
    "conformance.apis.fsdp2.plan",
    "conformance.apis.fsdp2_all_reduce.plan",
    "conformance.apis.fsdp2_replica.plan",
    "conformance.apis.fsdp2_all_gather.plan",
)

#: Every hook API, by ``HookSpec.api``.
HOOK_APIS: Dict[str, HookApi] = {api.name: api for module in ADAPTERS
                                 for api in importlib.import_module(module).APIS}


def api_of_test(test_name: str) -> Optional[HookApi]:
    """The API whose case plan has the suite test function ``test_name``, or ``None``."""
    for api in HOOK_APIS.values():
        if test_name in api.plans:
            return api
    return None


def suite_test(case: CaseParams) -> SuiteTest:
    """The suite test a case was planned for (its API's, by the case's check); ``KeyError`` names the unknown."""
    api = HOOK_APIS.get(case.api)
    if api is None:
        raise KeyError(f"case {case.id} names api {case.api!r}, which no API plan defines; known: {', '.join(HOOK_APIS)}")
    return api.suite_test(case.check)


def planned_cases(test_name: str, specs: Sequence[Any], settings: Settings) -> List[Any]:
    """The cases of suite test ``test_name`` for the specs of its API among ``specs``, as the suite runs them.

    Each :class:`~conformance.cases.CaseParams` has ``skip`` set where it cannot
    run here: its world size's availability first
    (:meth:`~conformance.controller.settings.Settings.world_size_unavailable`), then the
    plan's own reason.

    Raises:
        KeyError: no API plans ``test_name``.
    """
    api = api_of_test(test_name)
    if api is None:
        raise KeyError(f"no hook API plans a suite test named {test_name!r}")
    mine = [spec for spec in specs if spec.api == api.name]
    return [dataclasses.replace(case, skip=settings.world_size_unavailable(case.world_size) or case.skip)
            for case in api.plans[test_name](mine, settings)]
