"""Rank-side checks: the code each rank runs for one case.

A rank check is a function ``check(ctx, spec, **params) -> value`` registered
under a name with :func:`rank_check`. It runs in every rank process of a pool
(``ctx`` is a :class:`conformance.ranks.worker.RankContext`) and returns picklable
results: a list of :class:`conformance.protocol.Finding` (empty when the hook
conforms), or a :class:`conformance.protocol.CheckResult` with figures or the
per-step gradients the controller compares across ranks. A check that may
raise after it has seen the hook go wrong registers what it has found so far
with ``ctx.report_on_error`` (the lock-step loop does, per step), so the
failure shows it above the rank's traceback.

Each hook API's checks live in its adapter module (``conformance/apis/``,
listed in :data:`conformance.apis.registry.ADAPTERS`); here is what they share:
``common.py`` (the lock-step loop, named gradients, ``clipped``), ``groups.py``
(data-parallel subgroups), ``probe.py`` (hard inputs) and ``lossy.py`` (lossy contracts).
"""

from __future__ import annotations

from typing import Callable, Dict

_RANK_CHECKS: Dict[str, Callable] = {}
#: Checks that accept ``reference_only=True``: train the reference model alone, no hook.
REPLAYS_REFERENCE = frozenset({"fsdp.parity", "ddp.parity", "fsdp2.parity", "fsdp.clip_grad_norm",
                               "ddp.clip_grad_norm", "fsdp2.clip_grad_norm"})
#: Checks whose parameters hold for any spec of their API, and whose reference is PyTorch's behaviour on
#: this torch version: a failure that no cause of the hook's own explains is replayed with PyTorch's own
#: default hook in its place (:mod:`conformance.controller.default_replay`).
REPLAYS_DEFAULT_HOOK = frozenset({"fsdp.averaging", "fsdp.parity", "fsdp.clip_grad_norm", "fsdp.rank_grads",
                                  "ddp.averaging", "ddp.parity", "ddp.clip_grad_norm", "ddp.rank_grads",
                                  "fsdp2.parity", "fsdp2.clip_grad_norm"})


def rank_check(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the rank check called ``name`` (e.g. ``"fsdp.parity"``).

    A check in :data:`REPLAYS_REFERENCE` takes ``reference_only=True``: it then
    builds and trains only its reference model (the native path, no hook), so
    the controller can tell a reference that PyTorch cannot run here from a
    hook that broke it (:meth:`conformance.controller.runner.Runner.run`). A check in
    :data:`REPLAYS_DEFAULT_HOOK` runs the same with any spec of its API, so the
    controller can replay a case with PyTorch's own default hook.
    """

    def register(fn: Callable) -> Callable:
        if name in _RANK_CHECKS:
            raise ValueError(f"rank check {name!r} registered twice")
        _RANK_CHECKS[name] = fn
        return fn

    return register


def register_every_check() -> None:
    """Import every adapter module (:data:`conformance.apis.registry.ADAPTERS`), which registers its API's
    checks, and the lossy-contract checks. Idempotent."""
    import importlib

    from conformance.apis.registry import ADAPTERS

    for module in ADAPTERS + ("conformance.ranks.checks.lossy",):
        importlib.import_module(module)


def get_rank_check(name: str) -> Callable:
    """The rank check called ``name``; ``KeyError`` names the known checks.

    The first call registers every check (:func:`register_every_check`).
    """
    register_every_check()
    try:
        return _RANK_CHECKS[name]
    except KeyError:
        raise KeyError(f"no rank check {name!r}; known: {', '.join(sorted(_RANK_CHECKS))}") from None
