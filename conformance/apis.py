"""The hook APIs the suite knows: one :class:`HookApi` each, in :data:`HOOK_APIS`.

This registry is the one place that says, per API, how a hook is installed,
what its cases vary, whether the hook takes a state, how a spec's hook is
validated, where PyTorch's own hooks for it are, and which module holds its
rank checks. ``HookSpec`` validation, the built-in hook targets, the rank-check
registry and the case types all read it.

Adding a hook API: its entry here; its rank checks (a module under
``conformance/checks/`` built on ``checks.common.lockstep``); its built-in set
under ``conformance/builtin_hooks/``; its suite module under
``conformance/suite/``; a zoo in ``tests/zoo/``; its README section.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from conformance.spec import (FSDP_STRATEGIES, SpecError, binds_signature, qualname, signature_text,
                              strategies_from_signature)

__all__ = ["HOOK_APIS", "HookApi"]


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
        checks_module: the module that registers the API's rank checks.
    """

    name: str
    installed_with: str
    variant_field: str
    stateful: bool
    validate: Callable[[Any], Tuple[str, ...]]
    builtin_hooks: Optional[str]
    checks_module: str


def _no_strategies(spec: Any) -> None:
    if spec.strategies is not None:
        raise SpecError(f"HookSpec {spec.name!r}: strategies apply to api='fsdp' only, not {spec.api!r}")


def _validate_fsdp(spec: Any) -> Tuple[str, ...]:
    """FSDP calls ``hook(state, grad)`` under NO_SHARD and ``hook(state, grad, output)`` when sharded."""
    supported = strategies_from_signature(spec.hook)
    if not supported:
        raise SpecError(
            f"HookSpec {spec.name!r}: hook {qualname(spec.hook)}{signature_text(spec.hook)} "
            "accepts neither (state, grad) for NO_SHARD nor (state, grad, output) for "
            "sharded strategies"
        )
    if spec.strategies is None:
        return supported
    strategies = (spec.strategies,) if isinstance(spec.strategies, str) else tuple(spec.strategies)
    unknown = [s for s in strategies if s not in FSDP_STRATEGIES]
    if unknown or not strategies:
        raise SpecError(
            f"HookSpec {spec.name!r}: unknown strategies {unknown or strategies!r}; "
            f"expected names from {', '.join(FSDP_STRATEGIES)}"
        )
    unfit = [s for s in strategies if s not in supported]
    if unfit:
        raise SpecError(
            f"HookSpec {spec.name!r}: strategies {unfit} need a hook signature of "
            f"{'(state, grad)' if 'NO_SHARD' in unfit else '(state, grad, output)'}, but the "
            f"hook is {qualname(spec.hook)}{signature_text(spec.hook)}"
        )
    return strategies


def _called_as(nargs: int, convention: str) -> Callable[[Any], Tuple[str, ...]]:
    """A validator for an API that calls ``hook`` with ``nargs`` positional arguments, as ``convention`` says."""
    count = {1: "one argument", 2: "two arguments"}[nargs]

    def validate(spec: Any) -> Tuple[str, ...]:
        _no_strategies(spec)
        if not binds_signature(spec.hook, nargs):
            raise SpecError(f"HookSpec {spec.name!r}: {convention}, but {qualname(spec.hook)}"
                            f"{signature_text(spec.hook)} cannot take {count}")
        return ()

    return validate


def _validate_fsdp2(spec: Any) -> Tuple[str, ...]:
    _no_strategies(spec)
    # A class is a factory (called with no arguments), even though it has an allocate attribute.
    is_comm = not isinstance(spec.hook, type) and callable(getattr(spec.hook, "allocate", None))
    if not is_comm and not binds_signature(spec.hook, 0):
        raise SpecError(
            f"HookSpec {spec.name!r}: for api='fsdp2' the hook is a ReduceScatter comm (an object "
            "with allocate() and __call__(output, input, group, op, async_op)) or a factory "
            f"called with no arguments that returns one; got {qualname(spec.hook)}"
            f"{signature_text(spec.hook)}"
        )
    return ()


#: Every hook API, by ``HookSpec.api``, in the order the report lists them.
HOOK_APIS: Dict[str, HookApi] = {api.name: api for api in (
    HookApi("fsdp", "FullyShardedDataParallel.register_comm_hook(state, hook)", "strategy", True,
            _validate_fsdp, "conformance.builtin_hooks.fsdp:FSDP_HOOKS", "conformance.checks.fsdp"),
    HookApi("ddp", "DistributedDataParallel.register_comm_hook(state, hook)", "config", True,
            _called_as(2, "a DDP hook is called as hook(state, bucket) and returns a torch.futures.Future"),
            "conformance.builtin_hooks.ddp:DDP_HOOKS", "conformance.checks.ddp"),
    HookApi("fsdp2", "FSDPModule.set_custom_reduce_scatter(comm)", "config", False,
            _validate_fsdp2, "conformance.builtin_hooks.fsdp2:FSDP2_HOOKS", "conformance.checks.fsdp2"),
    HookApi("fsdp2_all_reduce", "FSDPModule.set_all_reduce_hook(hook) (HSDP)", "config", False,
            _called_as(1, "an FSDP2 all-reduce hook is called as hook(tensor)"), None, "conformance.checks.fsdp2"),
)}
