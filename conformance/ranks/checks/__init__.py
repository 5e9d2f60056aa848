"""Rank-side checks: the code each rank runs for one case, found by name (:func:`get_rank_check`).

A rank check is ``check(ctx, spec, **params) -> value``, registered as
``<api>.<name>``. It runs in every rank process of a pool (``ctx`` is a
:class:`conformance.ranks.worker.RankContext`, or a subgroup's view of one: its type is
:class:`~conformance.ranks.checks.groups.CheckContext`) and returns picklable results: a
list of :class:`conformance.protocol.Finding` (empty when the hook conforms),
or a :class:`conformance.protocol.CheckResult` with figures or the per-step
gradients the controller compares across ranks. A check that may raise after
it has seen the hook go wrong registers what it has found so far with
``ctx.report_on_error`` (the lock-step loop does, per step), so the failure
shows it above the rank's traceback.

Two kinds, both named by the API's :class:`~conformance.apis.HookApi`:

* the **shared checks** (:data:`~conformance.ranks.checks.common.SHARED_CHECKS`), written once over
  :class:`~conformance.ranks.checks.models.ApiModels`, one per entry of the check catalogue
  (:data:`conformance.catalogue.CATALOGUE`, which says how each trains, whether it is replayed and where it
  runs): averaging, parity, clip_grad_norm_, hard inputs, rank gradients, the second model and the three
  lossy-contract checks. Each function registers itself under its entry's name
  (:func:`~conformance.ranks.checks.common.shared_check`); each one an API's suite tests run is registered for
  it, bound to its models class (``HookApi.models``), as PyTorch's ``_get_grads`` takes the hook type;
* an API's **own checks** (``HookApi.checks``): FSDP1's registration rules,
  DDP's future contract.

The modules: ``models.py`` (the protocol), ``common.py`` (named tensors, the
training step), ``lockstep.py`` (the lock-step loop), ``exact.py``,
``long_run.py``, ``clip.py``, ``probe.py`` and ``lossy.py`` (the shared checks), ``groups.py``
(data-parallel subgroups).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Dict

from conformance.apis.registry import HOOK_APIS
from conformance.catalogue import CATALOGUE
from conformance.ranks.checks import clip, exact, long_run, lossy, probe  # noqa: F401  (each registers its checks)
from conformance.ranks.checks.common import SHARED_CHECKS

__all__ = ["get_rank_check", "register_every_check"]


def _resolve(target: str) -> Any:
    """``module:ATTR`` -> the object (the API's models class, or one of its own checks)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=None)
def register_every_check() -> Dict[str, Callable[..., Any]]:
    """Every API's rank checks by name (``<api>.<name>``): the shared checks its suite tests run, bound to its
    models class (``check(ctx, spec, **params)`` calls ``run(ctx, spec, make=<models class>, **params)``), and its
    own checks. Imports every API's rank-side modules the first time (the worker
    calls it before its first case, so that import is not inside a case).

    Raises:
        KeyError: a suite test names a rank check that is neither shared nor the API's own, or a catalogue entry
            has no rank function registered.
    """
    missing = sorted(set(CATALOGUE) - set(SHARED_CHECKS))
    if missing:
        raise KeyError(f"the catalogue's checks {', '.join(missing)} have no rank function: decorate it with "
                       "@shared_check(name) (conformance/ranks/checks/common.py) in a module imported here")
    checks: Dict[str, Callable[..., Any]] = {}
    for api in HOOK_APIS.values():
        make = _resolve(api.models)
        for test in api.plans.values():
            name = test.rank_check
            if name in SHARED_CHECKS:
                checks[test.rank_check_name] = functools.partial(SHARED_CHECKS[name], make=make)  # no frame of its own
            elif name in api.checks:
                checks[test.rank_check_name] = _resolve(api.checks[name])
            else:
                raise KeyError(f"api {api.name!r}: suite test {test.check!r} runs rank check {name!r}, which is "
                               f"neither shared ({', '.join(SHARED_CHECKS)}) nor in its checks")
    return checks


def get_rank_check(name: str) -> Callable[..., Any]:
    """The rank check called ``name`` (``"fsdp.parity"``); ``KeyError`` names the known checks."""
    checks = register_every_check()
    try:
        return checks[name]
    except KeyError:
        raise KeyError(f"no rank check {name!r}; known: {', '.join(sorted(checks))}") from None
