"""Rank-side checks: the code each rank runs for one case.

A rank check is a function ``check(ctx, spec, **params) -> value`` registered
under a name with :func:`rank_check`. It runs in every rank process of a pool
(``ctx`` is a :class:`conformance.worker.RankContext`) and returns picklable
results: usually a list of :class:`conformance.protocol.Finding` (empty when
the hook conforms), or CPU tensors the controller compares across ranks.

One module per hook API (``fsdp.py``, ``ddp.py``, ``fsdp2.py``, named in
:data:`conformance.apis.HOOK_APIS`), plus what they share: ``common.py`` (the
lock-step loop) and ``lossy.py`` (lossy contracts).
"""

from __future__ import annotations

from typing import Callable, Dict

_RANK_CHECKS: Dict[str, Callable] = {}
#: Checks that accept ``reference_only=True``: train the reference model alone, no hook.
REPLAYS_REFERENCE = frozenset({"fsdp.parity", "ddp.parity", "fsdp2.parity"})


def rank_check(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the rank check called ``name`` (e.g. ``"fsdp.parity"``).

    A check in :data:`REPLAYS_REFERENCE` takes ``reference_only=True``: it then
    builds and trains only its reference model (the native path, no hook), so
    the controller can tell a reference that PyTorch cannot run here from a
    hook that broke it (:meth:`conformance.runner.Runner.run`).
    """

    def register(fn: Callable) -> Callable:
        if name in _RANK_CHECKS:
            raise ValueError(f"rank check {name!r} registered twice")
        _RANK_CHECKS[name] = fn
        return fn

    return register


def get_rank_check(name: str) -> Callable:
    """The rank check called ``name``; ``KeyError`` names the known checks."""
    try:
        return _RANK_CHECKS[name]
    except KeyError:
        raise KeyError(f"no rank check {name!r}; known: {', '.join(sorted(_RANK_CHECKS))}") from None


def _register_every_api() -> None:
    """Import each hook API's checks module (:data:`conformance.apis.HOOK_APIS`), which registers its checks."""
    import importlib

    from conformance.apis import HOOK_APIS

    for module in dict.fromkeys(api.checks_module for api in HOOK_APIS.values()):
        importlib.import_module(module)
    importlib.import_module("conformance.checks.lossy")  # the lossy-contract checks


_register_every_api()
