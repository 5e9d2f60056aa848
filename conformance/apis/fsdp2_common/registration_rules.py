"""FSDP2's registration rules, with the hook under test: what the suite's registration relies on.

FSDP2 installs a comm or a hook per FSDP module: ``FSDPModule.set_custom_reduce_scatter(comm)``
(``api="fsdp2"``), ``FSDPModule.set_custom_all_gather(comm)`` (``api="fsdp2_all_gather"``) and
``FSDPModule.set_all_reduce_hook(hook)`` (``api="fsdp2_all_reduce"``,
``api="fsdp2_replica"``) set it on the module's own parameter groups (``FSDPParamGroup``), and on
nothing else. The suite therefore registers on every FSDP module
(:func:`~conformance.apis.fsdp2_common.registration.register_on_every_module`, what every FSDP2
check's hooked model goes through), and these rules pin what that relies on, one rule per case, as
FSDP1's ``register_comm_hook`` rules do
(``conformance/apis/fsdp/registration.py``). Seen on torch 2.13 (CPU, gloo, 2 and 4 ranks):

* ``unset_before_registration``: before any registration, every parameter group holds FSDP2's own
  reduce-scatter (``DefaultReduceScatter``; ``None`` on older torch) and no all-reduce hook (``None``);
* ``reaches_every_param_group``: the suite's registration (the setter on every FSDP module) leaves the
  hook on every parameter group of the model, while the setter called on the root alone reaches the
  root's own groups only: the children keep the native path (a comm that counted its calls got 1 of the
  2 reduce-scatters per backward). That is the classic misuse;
* ``multiple_param_groups_raise``: on an FSDP module with several parameter groups
  (``fully_shard(..., shard_placement_fn=...)`` returning a ``ShardPlacementResult`` whose mesh has
  another process group: one group per process group), the setter raises PyTorch's ``ValueError``
  ("set_custom_reduce_scatter is not supported with multiple param groups (from per-param mesh via
  shard_placement_fn) ...") before it sets anything, and the suite's registration turns that into a
  :class:`~conformance.apis.fsdp2_common.registration.RegistrationRefused` naming the module's FQN, the
  setter, PyTorch's message and the fix;
* ``stream_under_hsdp_raises`` (``set_all_reduce_hook`` under native HSDP only):
  ``set_all_reduce_hook(hook, stream=...)`` raises ``ValueError("stream cannot be set when using native
  HSDP")`` (after it has set the hook on the module's first parameter group; on a 1-D mesh the stream is
  accepted).

Whose failure a rule's finding is: registering runs no code of the hook's (PyTorch's setters check
nothing of the object they are given), so every rule holds whatever the hook is. The hook's own code
runs only where the suite makes the object it registers (a comm factory, a replica hook's state); if
that raises, the case fails with the hook's traceback, as every other check of the API would. A
finding states which rule fails, a fact: one of PyTorch's own (its text starts "PyTorch changed", with
the torch version; kind ``"torch_rule_broken"``) or one the suite's own registration relies on (its text
says so; kind ``"suite_rule_broken"``). The attribution decides from the kinds
(:func:`conformance.controller.attribution.attribute`): the case is skipped with the text as the reason,
or ``NOT RUN`` where the suite's rule fails; neither blames the hook.

The rule names and the plan are in ``plan.py`` (:data:`~conformance.apis.fsdp2_common.plan.REGISTRATION_RULES`);
each API's rank check is :func:`registration_check` of its setup object, in its ``models.py``.
Everything FSDP2 is looked up when used, as in ``build.py``: this module imports on a torch without FSDP2.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, List, Tuple

import torch
from torch import nn

from conformance.apis.fsdp2_common.build import build_fsdp2, mesh_for, several_groups_model
from conformance.apis.fsdp2_common.plan import HSDP_STREAM_RULE, REGISTRATION_RULES
from conformance.apis.fsdp2_common.registration import (MULTIPLE_PARAM_GROUPS, RegistrationRefused, Setter,
                                                        fsdp_modules_by_fqn, module_place, param_groups,
                                                        register_on_every_module)
from conformance.apis.fsdp2_common.setup import Fsdp2Setup
from conformance.protocol import Finding, FindingKind

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

__all__ = ["HSDP_STREAM", "REGISTRATION_MODEL", "SEVERAL_GROUPS_FQN", "check_rule", "registration_check"]

#: ``FSDPModule.set_all_reduce_hook(hook, stream=...)`` under native HSDP (torch 2.13).
HSDP_STREAM = r"^stream cannot be set when using native HSDP$"
#: The model of the unset and reaching rules: several FSDP modules, nested (``nested_wrapped``).
REGISTRATION_MODEL = "nested_wrapped"
#: The FQN of the FSDP module :func:`several_groups_model` gives several parameter groups.
SEVERAL_GROUPS_FQN = "module"


def _torch_rule_broken(ctx: CheckContext, text: str, kind: str = "torch_rule_broken") -> Finding:
    """A rule that holds whatever the hook is does not hold on this torch (kind ``"torch_rule_broken"``);
    ``kind=FindingKind.SUITE_RULE_BROKEN`` where the suite's other checks rely on the rule."""
    return Finding(ctx.rank, f"PyTorch changed (torch {torch.__version__}): {text}; this rule holds whatever the "
                             "hook is, so this is not the hook's failure", kind=kind)


def _expect_value_error(ctx: CheckContext, fn: Callable[[], Any], pattern: str, what: str, why: str) -> List[Finding]:
    """``fn()`` must raise ``ValueError`` matching ``pattern`` (as torch 2.13 does); else a "PyTorch changed"
    finding, ``what`` being the call and ``why`` what a change would mean."""
    try:
        fn()
    except ValueError as exc:
        if re.search(pattern, str(exc)):
            return []
        got = f"raised ValueError({str(exc)!r})"
    except Exception as exc:  # noqa: BLE001 - any other outcome is the finding
        got = f"raised {type(exc).__name__}({exc})"
    else:
        got = "did not raise"
    return [_torch_rule_broken(ctx, f"{what} {got}; torch 2.13 raises ValueError matching {pattern!r}. {why}")]


def _native(value: object) -> bool:
    """Whether a parameter group's comm or hook is FSDP2's own: ``None``, or an object of torch's FSDP classes."""
    return value is None or type(value).__module__.startswith("torch.distributed.fsdp")


def _describe(value: object) -> str:
    """``None``, or the object's class and module (no address: the text is the same on every rank and run)."""
    return "None" if value is None else f"a {type(value).__qualname__} (from {type(value).__module__})"


def _listed(places: List[Tuple[str, int]]) -> str:
    return ", ".join(f"group {i} of {module_place(fqn)}" for fqn, i in places)


_MISSING = object()


def _unset(ctx: CheckContext, setter: Setter, model: nn.Module) -> List[Finding]:
    absent: List[Tuple[str, int]] = []
    held: List[Tuple[str, int, Any]] = []
    for fqn, module in fsdp_modules_by_fqn(model):
        for i, group in enumerate(param_groups(module)):
            value = getattr(group, setter.target, _MISSING)
            if value is _MISSING:
                absent.append((fqn, i))
            elif not _native(value):
                held.append((fqn, i, value))
    out = []
    if absent:
        out.append(_torch_rule_broken(ctx, f"the parameter groups ({_listed(absent)}) have no attribute "
                                         f"{setter.target}, which FSDPModule.{setter.name} set up to torch 2.13; "
                                         f"the suite cannot tell what they hold"))
    if held:  # every FSDP2 check compares with that reference: the run's failure, not a skip of this case alone
        out.append(_torch_rule_broken(ctx, f"before any FSDPModule.{setter.name}, the parameter groups "
                                         f"({_listed([(f, i) for f, i, _ in held])}) hold {_describe(held[0][2])} as "
                                         f"{setter.target}, where torch 2.13 holds {setter.default}; the reference "
                                         "the suite compares with (the model without a registration) may no "
                                         "longer be native", kind=FindingKind.SUITE_RULE_BROKEN))
    return out


def _reaches(ctx: CheckContext, setter: Setter, build: Callable[[], nn.Module], hook: object) -> List[Finding]:
    out = []
    model = build()
    modules = fsdp_modules_by_fqn(model)
    if len(modules) < 2 or not any(param_groups(m) for _, m in modules[1:]):
        return [Finding(ctx.rank, f"the registration model {REGISTRATION_MODEL} has no child FSDP module with "
                                  "parameters: the rule cannot be exercised (the suite's own model, not the hook)",
                        kind=FindingKind.SUITE_RULE_BROKEN)]
    register_on_every_module(model, setter.name, hook)
    missed = [(fqn, i, getattr(group, setter.target, None)) for fqn, module in modules
              for i, group in enumerate(param_groups(module)) if getattr(group, setter.target, None) is not hook]
    if missed:
        out.append(Finding(ctx.rank, (
            f"after the suite's registration (FSDPModule.{setter.name} on every FSDP module, {len(modules)} here, as "
            f"every check installs the {setter.what}), the parameter groups ({_listed([m[:2] for m in missed])}) "
            f"hold {_describe(missed[0][2])}, not the {setter.what} under test: their gradients would take "
            f"{setter.native}, and every check would pass without the {setter.what}. Registering on the root alone "
            f"is the classic misuse: FSDPModule.{setter.name} does not recurse into child FSDP modules, so the "
            "children's gradients stay on the native path. The suite registers on every FSDP module: this is the "
            "suite's registration, or PyTorch changed, not the hook's failure"), kind=FindingKind.SUITE_RULE_BROKEN))
    root_only = build()
    getattr(root_only, setter.name)(hook)
    groups = [(fqn, i, getattr(group, setter.target, None) is hook) for fqn, module in fsdp_modules_by_fqn(root_only)
              for i, group in enumerate(param_groups(module))]
    unset_root = [(fqn, i) for fqn, i, holds in groups if not fqn and not holds]
    reached = [(fqn, i) for fqn, i, holds in groups if fqn and holds]
    if unset_root:
        out.append(_torch_rule_broken(ctx, f"after root.{setter.name}(...) the root's own parameter groups "
                                         f"({_listed(unset_root)}) do not hold the {setter.what}"))
    if reached:
        out.append(_torch_rule_broken(ctx, (
            f"{setter.name} called on the root alone reached the children's parameter groups ({_listed(reached)}); "
            f"up to torch 2.13 it did not recurse, and a registration on the root alone left the children's "
            f"gradients on {setter.native} (the classic misuse). The suite's registration on every FSDP module "
            "still holds; the advice to register on every module needs review")))
    return out


def _several_groups(ctx: CheckContext, setter: Setter, build: Callable[[], nn.Module], hook: object) -> List[Finding]:
    model = build()
    several = dict(fsdp_modules_by_fqn(model))[SEVERAL_GROUPS_FQN]
    count = len(param_groups(several))
    if count < 2:
        return [_torch_rule_broken(ctx, (
            f"fully_shard(..., shard_placement_fn=...) returning a ShardPlacementResult on a mesh of this rank alone "
            f"for module.2's parameters gave FSDP module {SEVERAL_GROUPS_FQN!r} {count} parameter group(s), where "
            "torch 2.13 makes one per process group (2); the rule cannot be exercised"))]
    direct = _expect_value_error(
        ctx, lambda: getattr(several, setter.name)(hook), rf"^{re.escape(setter.name)} {MULTIPLE_PARAM_GROUPS}",
        f"FSDPModule.{setter.name} on FSDP module {SEVERAL_GROUPS_FQN!r}, whose {count} parameter groups are on "
        "different meshes (shard_placement_fn),",
        f"Check how the {setter.what} now reaches each parameter group before trusting the suite's registration on "
        "such a module")
    if direct:
        return direct
    try:
        register_on_every_module(build(), setter.name, hook)
    except RegistrationRefused as exc:
        cause = exc.__cause__
        text = str(exc)
        needed = [(f"the module's FQN {SEVERAL_GROUPS_FQN!r}", f"{SEVERAL_GROUPS_FQN!r}"),
                  (f"the setter {setter.name}", setter.name), ("PyTorch's message", str(cause)), ("the fix", "Fix:")]
        missing = [name for name, needle in needed if needle not in text]
        if isinstance(cause, ValueError) and not missing:
            return []
        return [Finding(ctx.rank, f"the suite's registration refusal lacks {', '.join(missing) or 'its cause'} "
                                  f"(PyTorch's ValueError): {text!r}; the suite's own message, not the hook's "
                                  "failure", kind=FindingKind.SUITE_RULE_BROKEN)]
    except Exception as exc:  # noqa: BLE001 - the finding says what came instead
        got = f"let {type(exc).__name__}({exc}) through bare"
    else:
        got = "did not raise"
    return [Finding(ctx.rank, f"the suite's registration (FSDPModule.{setter.name} on every FSDP module) on a model "
                              f"whose FSDP module {SEVERAL_GROUPS_FQN!r} has {count} parameter groups {got}, where "
                              "it must raise RegistrationRefused naming the module, the setter, PyTorch's message and "
                              "the fix; the suite's registration, not the hook's failure", kind=FindingKind.SUITE_RULE_BROKEN)]


def _a_stream(ctx: CheckContext) -> Any:
    """A stream of the rank's device (``torch.Stream``, torch >= 2.3), or a stand-in: FSDP2 checks only that one
    was given."""
    make = getattr(torch, "Stream", None)
    try:
        return make(device=ctx.device) if make is not None else object()
    except Exception:  # noqa: BLE001 - a device without streams: any object is a stream to the check
        return object()


def check_rule(ctx: CheckContext, spec: HookSpec, setter: Setter, mesh: DeviceMesh, hook: object,
               rule: str) -> List[Finding]:
    """One registration rule (:data:`~conformance.apis.fsdp2_common.plan.REGISTRATION_RULES`, or
    :data:`~conformance.apis.fsdp2_common.plan.HSDP_STREAM_RULE` on a 2-D mesh) of ``setter`` with ``hook`` (the object
    the suite registers for ``spec``), on models under ``fully_shard`` on ``mesh`` (1-D, a 1-D sub-mesh, or 2-D
    for native HSDP) in ``spec``'s reduce dtype. Returns the findings, each PyTorch's or the suite's (see the
    module docstring).

    Raises:
        ValueError: an unknown rule.
    """
    ctx.phase(f"registration rule {rule}")
    if rule == "unset_before_registration":
        return _unset(ctx, setter, build_fsdp2(REGISTRATION_MODEL, ctx, mesh, reduce_dtype=spec.reduce_dtype))
    if rule == "reaches_every_param_group":
        return _reaches(ctx, setter, lambda: build_fsdp2(REGISTRATION_MODEL, ctx, mesh,
                                                         reduce_dtype=spec.reduce_dtype), hook)
    if rule == "multiple_param_groups_raise":
        return _several_groups(ctx, setter, lambda: several_groups_model(ctx, mesh, spec.reduce_dtype), hook)
    if rule == HSDP_STREAM_RULE:
        model = build_fsdp2(REGISTRATION_MODEL, ctx, mesh, reduce_dtype=spec.reduce_dtype)
        return _expect_value_error(ctx, lambda: model.set_all_reduce_hook(hook, stream=_a_stream(ctx)), HSDP_STREAM,
                                   "FSDPModule.set_all_reduce_hook(hook, stream=...) under native HSDP",
                                   "Under native HSDP FSDP2 runs the hook in its own all-reduce stream")
    known = REGISTRATION_RULES + (HSDP_STREAM_RULE,)
    raise ValueError(f"unknown registration rule {rule!r}; known: {', '.join(known)}")


def registration_check(setup: Fsdp2Setup, setter: Setter) -> Callable[..., List[Finding]]:
    """An FSDP2 API's rank check ``<api>.registration``: ``registration(ctx, spec, *, config, rule)``, one rule of
    ``setter`` (the API's ``setup.setter``) with the object the suite registers for ``spec``
    (``setup.bind``), on the mesh the hooked model of ``config`` shards on (the config's mesh over the pool,
    or its ``hooked_dim`` alone).

    Raises:
        ValueError: ``setter`` is not the setup's.
    """
    if setter.name != setup.setter:
        raise ValueError(f"the rules of {setter.name} checked for a hook installed with {setup.setter}")

    def registration(ctx: CheckContext, spec: HookSpec, *, config: str, rule: str) -> List[Finding]:
        layout = setup.configs[config]
        grid = mesh_for(ctx, layout.shape(ctx.world_size))
        hook = setup.bound(spec.hook, spec.state, spec.name, grid)
        mesh = grid[layout.hooked_dim] if layout.hooked_dim else grid
        return check_rule(ctx, spec, setter, mesh, hook, rule)

    return registration
