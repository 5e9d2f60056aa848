"""Each hook API's controller side: the parts of its folder the controller, the reports and the reproducers use.

An API's folder has three halves (docs/layers.md): its plan, which the registry loads by name
(:data:`conformance.apis.registry.ADAPTERS`); its rank side (``models.py``, its own checks), which the rank
checks bind by name (``HookApi.models``, ``HookApi.checks``); and its **controller side**, declared here:

* ``builtin_hooks.py``: PyTorch's own hooks for the API as specs (the module ``HookApi.builtin_hooks`` names as a
  hook target), and its ``default_hook``, with which the controller replays a failure that could be PyTorch's
  (:mod:`conformance.controller.default_replay`);
* its standalone part (``standalone.py``; the FSDP2 family's shared build before it), importing only torch, which
  every standalone reproducer of its cases holds (:mod:`conformance.reproducers`).

This module imports each of them with an import statement, so import-linter sees every way from the controller's
side into an API's folder: the ``apis-by-name`` contract lets the controller's side reach an API's folder only
through here (its ``builtin_hooks`` and standalone modules), and ``controller-off-ranks`` forbids that any of it
import ``conformance.ranks``, directly or not (pyproject.toml, ``[tool.importlinter]``). ``tests/test_layers.py``
checks that every module an API names for the controller's side is one this module imports.

Each API's parts are imported on first use (:func:`controller_side`): all of them together import
torch.distributed's DDP hooks and FSDP2's internals, seconds that a run which replays no default hook and writes no
reproducer does without. Adding a hook API adds its loader to :data:`SIDES` (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec  # typing only: the builtin_hooks modules below import it

__all__ = ["ControllerSide", "DefaultHook", "SIDES", "controller_side"]

#: ``default_hook(spec, params, world_size)``: the name, among the API's built-in hook specs, of PyTorch's own
#: default hook for a case of ``spec`` at ``world_size`` with the rank check's ``params``, one whose result equals
#: the native path's arithmetic bit for bit there; ``None`` where no built-in hook does.
DefaultHook = Callable[["HookSpec", Dict[str, Any], int], Optional[str]]


@dataclasses.dataclass(frozen=True)
class ControllerSide:
    """One hook API's parts on the controller's side, each a module :mod:`conformance.apis.controller_side` imports.

    Attributes:
        builtin_hooks: the module of PyTorch's own hooks for the API as specs, the one whose ``module:ATTR`` hook
            target ``HookApi.builtin_hooks`` is (``--hook`` takes the target; this module is what it imports);
            ``None``: the API has no built-in hooks.
        default_hook: the API's :data:`DefaultHook`, with which the runner replays a failure that could be
            PyTorch's (:mod:`conformance.controller.default_replay`): DDP's ``allreduce_hook`` where its divide
            then SUM rounds as DDP's own averaging does (``Reducer::mark_variable_ready_dense``: each gradient
            times ``1/world_size``, then SUM; equal where the world size is a power of two), FSDP's
            ``allreduce_hook``/``reduce_scatter_hook`` (pre-divide, SUM, post-divide, as ``_reduce_grad``), the
            FSDP2 family's plain comms, which pass FSDP2's ``op`` through as its native path does; ``None``: none.
        standalone: the modules of the API's standalone part, importing only torch, in the order a reproducer
            holds them: how the suite builds the API's native and hooked models (DDP's ``standalone.py``; the
            FSDP2 family's shared setup and build, then the API's own ``SETUP``); ``()``: no reproducers.
    """

    builtin_hooks: Optional[ModuleType] = None
    default_hook: Optional[DefaultHook] = None
    standalone: Tuple[ModuleType, ...] = ()

    @property
    def standalone_modules(self) -> Tuple[str, ...]:
        """The names of :attr:`standalone`'s modules, in order (``()``: none)."""
        return tuple(module.__name__ for module in self.standalone)

    @property
    def modules(self) -> Tuple[ModuleType, ...]:
        """Every module of this side: :attr:`builtin_hooks` (where there is one) and :attr:`standalone`."""
        return (*([self.builtin_hooks] if self.builtin_hooks is not None else []), *self.standalone)


def _fsdp() -> ControllerSide:
    from conformance.apis.fsdp import builtin_hooks, standalone
    return ControllerSide(builtin_hooks, builtin_hooks.default_hook, (standalone,))


def _ddp() -> ControllerSide:
    from conformance.apis.ddp import builtin_hooks, standalone
    return ControllerSide(builtin_hooks, builtin_hooks.default_hook, (standalone,))


def _fsdp2_family(own: ModuleType) -> Tuple[ModuleType, ...]:
    """An FSDP2 API's standalone part: the family's setup object and build, then the API's own ``SETUP``."""
    from conformance.apis.fsdp2_common import setup, standalone
    return (setup, standalone, own)


def _fsdp2() -> ControllerSide:
    from conformance.apis.fsdp2 import builtin_hooks, standalone
    return ControllerSide(builtin_hooks, builtin_hooks.default_hook, _fsdp2_family(standalone))


def _fsdp2_all_reduce() -> ControllerSide:
    from conformance.apis.fsdp2_all_reduce import standalone
    return ControllerSide(standalone=_fsdp2_family(standalone))


def _fsdp2_replica() -> ControllerSide:
    from conformance.apis.fsdp2_replica import builtin_hooks, standalone
    return ControllerSide(builtin_hooks, builtin_hooks.default_hook, _fsdp2_family(standalone))


def _fsdp2_all_gather() -> ControllerSide:
    from conformance.apis.fsdp2_all_gather import builtin_hooks, standalone
    return ControllerSide(builtin_hooks, builtin_hooks.default_hook, _fsdp2_family(standalone))


#: Every hook API's controller side, by ``HookSpec.api``: the function that imports it. Every API of the registry
#: (:data:`conformance.apis.registry.HOOK_APIS`) has one (``tests/test_layers.py``).
SIDES: Mapping[str, Callable[[], ControllerSide]] = {
    "fsdp": _fsdp,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    "fsdp2_all_reduce": _fsdp2_all_reduce,
    "fsdp2_replica": _fsdp2_replica,
    "fsdp2_all_gather": _fsdp2_all_gather,
}


@functools.lru_cache(maxsize=None)
def controller_side(api: str) -> ControllerSide:
    """The controller side of the hook API ``api`` (``HookSpec.api``), its modules imported on the first call.

    Raises:
        KeyError: :data:`SIDES` has no API ``api``; the message names those it has.
    """
    load = SIDES.get(api)
    if load is None:
        raise KeyError(f"api {api!r} declares no controller side in conformance/apis/controller_side.py; "
                       f"known: {', '.join(SIDES)}")
    return load()
