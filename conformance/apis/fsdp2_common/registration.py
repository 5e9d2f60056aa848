"""The suite's registration of an FSDP2 comm or hook: the setter on every FSDP module, and its refusal.

FSDP2 installs a comm or a hook per FSDP module: ``FSDPModule.set_custom_reduce_scatter(comm)``,
``FSDPModule.set_custom_all_gather(comm)`` and ``FSDPModule.set_all_reduce_hook(hook)`` set it on the
module's own parameter groups (``FSDPParamGroup``), and on nothing else. The suite therefore registers on every FSDP module
(:func:`register_on_every_module`, what every FSDP2 check's hooked model goes through); where
PyTorch refuses a module of several parameter groups, the suite says which module, why and the fix
(:class:`RegistrationRefused`). :class:`Setter` describes each setter for the registration rules
(``registration_rules.py``), which pin what this registration relies on.
Everything FSDP2 is looked up when used, as in ``build.py``: this module imports on a torch without FSDP2.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Tuple

from torch import nn

from conformance.apis.fsdp2_common.standalone import fsdp2_api

__all__ = ["ALL_GATHER", "ALL_REDUCE_HOOK", "MULTIPLE_PARAM_GROUPS", "REDUCE_SCATTER", "RegistrationRefused", "Setter",
           "fsdp_modules_by_fqn", "module_place", "param_groups", "refusal_message", "register_on_every_module"]


@dataclasses.dataclass(frozen=True)
class Setter:
    """An ``FSDPModule`` setter of a hook API.

    Attributes:
        name: the method (``"set_custom_reduce_scatter"``).
        target: the ``FSDPParamGroup`` attribute it sets (``"_reduce_scatter_comm"``).
        what: the object it installs, for messages (``"comm"``).
        default: what the target holds before any registration (torch 2.13), for messages.
        native: the path a parameter group without it takes, for messages.
    """

    name: str
    target: str
    what: str
    default: str
    native: str


REDUCE_SCATTER = Setter("set_custom_reduce_scatter", "_reduce_scatter_comm", "comm",
                        "FSDP2's own DefaultReduceScatter (None on older torch)",
                        "FSDP2's own reduce-scatter (DefaultReduceScatter)")
ALL_GATHER = Setter("set_custom_all_gather", "_all_gather_comm", "all-gather comm",
                    "FSDP2's own DefaultAllGather", "FSDP2's own all-gather (DefaultAllGather)")
ALL_REDUCE_HOOK = Setter("set_all_reduce_hook", "_all_reduce_hook", "all-reduce hook", "None",
                         "FSDP2's path without a hook (under native HSDP its own all-reduce alone; on a 1-D mesh "
                         "no reduction across replicas at all)")

#: What PyTorch's setters say when an FSDP module has several parameter groups (torch 2.13,
#: ``FSDPModule.set_custom_reduce_scatter`` / ``set_all_reduce_hook`` / ``set_custom_all_gather``).
MULTIPLE_PARAM_GROUPS = r"is not supported with multiple param groups"


class RegistrationRefused(ValueError):
    """FSDP2 refused the suite's registration of a comm or hook on one FSDP module (PyTorch's ``ValueError``
    as its ``__cause__``); the message names the module's FQN, the setter, PyTorch's message and the fix."""


def fsdp_modules_by_fqn(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(fqn, module)`` of every FSDP2 module of ``model``, root (``""``) first, in ``model.modules()`` order."""
    _, _, FSDPModule = fsdp2_api()
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]


def param_groups(module: nn.Module) -> List[Any]:
    """The ``FSDPParamGroup`` s of one FSDP module: ``state._fsdp_param_groups`` (torch 2.13), or the one
    ``state._fsdp_param_group`` of older torch; ``[]`` for a module without parameters of its own."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]


def module_place(fqn: str) -> str:
    """An FSDP module's FQN for messages: ``'module.1'``, or ``'' (the root)``."""
    return f"{fqn!r}" if fqn else "'' (the root)"


# group: object, as FSDP2's FSDPParamGroup is private to torch (its module has moved between versions); read with
# getattr alone.
def _group_params(module: nn.Module, fqn: str, group: object) -> str:
    """The FQNs of a parameter group's parameters, and its shard group's size."""
    mine = {id(p): name for name, p in module.named_parameters()}
    names = [mine.get(id(getattr(fp, "sharded_param", None)), "?") for fp in getattr(group, "fsdp_params", ())]
    names = [f"{fqn}.{n}" if fqn else n for n in names]
    size = getattr(getattr(group, "mesh_info", None), "shard_mesh_size", "?")
    return f"{', '.join(names) or '?'} (a shard group of {size} rank{'' if size == 1 else 's'})"


def refusal_message(fqn: str, module: nn.Module, setter: str, exc: BaseException) -> str:
    """What :func:`register_on_every_module` says when FSDP module ``fqn`` has several parameter groups."""
    groups = param_groups(module)
    listed = "; ".join(f"group {i}: {_group_params(module, fqn, g)}" for i, g in enumerate(groups))
    return (f"FSDPModule.{setter} on FSDP module {module_place(fqn)} raised ValueError: {exc} The module has "
            f"{len(groups)} parameter groups, one per process group ({listed}): fully_shard(..., "
            "shard_placement_fn=...) returned a ShardPlacementResult with a mesh of its own for some of its "
            "parameters, and FSDP2 will not give one comm or hook to parameter groups on different meshes. "
            "Fix: give those parameters an FSDP module of their own, fully_shard(the submodule that holds them, "
            f"mesh=their mesh) before fully_shard on {module_place(fqn)} and without a shard_placement_fn that moves "
            "them, so that every FSDP module has one parameter group; then call the setter on every FSDP module")


def register_on_every_module(model: nn.Module, setter: str, hook: object) -> int:
    """``FSDPModule.<setter>(hook)`` on every FSDP module of ``model``: the suite's registration of a comm or hook
    (the setters set the module's own parameter groups only, they do not recurse). Returns the number of FSDP
    modules.

    Raises:
        RegistrationRefused: PyTorch refused an FSDP module with several parameter groups (``ValueError``
            matching :data:`MULTIPLE_PARAM_GROUPS`, its cause), naming the module's FQN, the setter, PyTorch's
            message and the fix. Any other error of the setter propagates as it is.
    """
    modules = fsdp_modules_by_fqn(model)
    for fqn, module in modules:
        try:
            getattr(module, setter)(hook)
        except ValueError as exc:
            if not re.search(MULTIPLE_PARAM_GROUPS, str(exc)):
                raise
            raise RegistrationRefused(refusal_message(fqn, module, setter, exc)) from exc
    return len(modules)
