"""Hook API adapters: one module per hook API, each exporting ``APIS``, its :class:`HookApi` entries.

An adapter is everything the suite knows about one way of installing a hook:

* on the controller: how a spec's hook is validated against the API's calling
  convention, what its cases vary (the *variant*: a sharding strategy, a DDP
  config, an FSDP2 config), and its **case plan** per suite test, with the
  reason a case cannot run here;
* on the ranks: how the reference model and the hooked model (with a recorder
  around the hook) are built and trained, and its rank checks, registered with
  :func:`conformance.ranks.checks.rank_check` and built on the one lock-step loop,
  :func:`conformance.ranks.checks.common.lockstep`.

``conformance.apis.registry`` lists the adapter modules and builds the registry
:data:`conformance.apis.registry.HOOK_APIS` from their ``APIS``; spec validation, the
built-in hook sets, the rank-check registry and the suite's parametrization
(:func:`conformance.controller.pytest_plugin.pytest_generate_tests`) all read it.

Adapters: ``fsdp`` (FSDP1 ``register_comm_hook``), ``ddp`` (DDP
``register_comm_hook``), ``fsdp2`` (``set_custom_reduce_scatter`` and HSDP
``set_all_reduce_hook``). API-specific extras live beside them: ``fsdp_registration``
(``register_comm_hook``'s rules), ``ddp_reference`` (DDP's reference per claim),
``ddp_future`` (DDP's future contract), ``fsdp2_build`` (meshes and ``fully_shard``),
``fsdp2_recorders`` (what FSDP2 hands a comm or a hook).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple

from conformance.spec import SpecError, binds_signature, qualname, signature_text

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

__all__ = ["HookApi", "CasePlan", "called_as", "no_strategies"]

#: ``plan(specs, settings)``: the cases of one suite test for the API's specs, each with its
#: ``skip`` reason set where it cannot run here (the world size's availability is checked
#: by the caller, first).
CasePlan = Callable[[Sequence["HookSpec"], "Settings"], List["CaseParams"]]


@dataclasses.dataclass(frozen=True)
class HookApi:
    """What the suite knows about one hook API.

    Attributes:
        name: the value of ``HookSpec.api``.
        installed_with: how a hook is installed, the PyTorch call (for messages and docs).
        variant_field: what the API's cases vary, by name: ``"strategy"`` (a
            ``ShardingStrategy``) or ``"config"``.
        stateful: the hook takes a state built on each rank by ``spec.state(process_group)``.
        validate: ``validate(spec)`` checks the spec's hook against the API's
            calling convention and returns the spec's strategies (``fsdp``) or
            ``()``; raises :class:`~conformance.spec.SpecError`.
        builtin_hooks: ``module:ATTR`` of PyTorch's own hooks as specs, or ``None``.
        plans: suite test function name -> :data:`CasePlan`; the suite tests of
            this API are exactly these.
        default_hook: ``module:ATTR`` of ``default_hook(spec, params, world_size) ->
            Optional[str]``: the name, among ``builtin_hooks``, of PyTorch's own
            default hook for a case of ``spec`` with the rank check's ``params``,
            one whose result equals the native path's arithmetic bit for bit there;
            ``None`` where no built-in hook does. The runner replays a failure that
            could be PyTorch's with it (:mod:`conformance.controller.default_replay`).
    """

    name: str
    installed_with: str
    variant_field: str
    stateful: bool
    validate: Callable[[Any], Tuple[str, ...]]
    builtin_hooks: Optional[str]
    plans: Mapping[str, CasePlan]
    default_hook: Optional[str] = None


def no_strategies(spec: Any) -> None:
    """Raise :class:`SpecError` if ``spec.strategies`` is set: only ``api="fsdp"`` takes strategies."""
    if spec.strategies is not None:
        raise SpecError(f"HookSpec {spec.name!r}: strategies apply to api='fsdp' only, not {spec.api!r}")


def called_as(nargs: int, convention: str) -> Callable[[Any], Tuple[str, ...]]:
    """A validator for an API that calls ``hook`` with ``nargs`` positional arguments, as ``convention`` says."""
    count = {1: "one argument", 2: "two arguments"}[nargs]

    def validate(spec: Any) -> Tuple[str, ...]:
        no_strategies(spec)
        if not binds_signature(spec.hook, nargs):
            raise SpecError(f"HookSpec {spec.name!r}: {convention}, but {qualname(spec.hook)}"
                            f"{signature_text(spec.hook)} cannot take {count}")
        return ()

    return validate
