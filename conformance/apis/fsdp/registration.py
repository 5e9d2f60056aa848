"""``FullyShardedDataParallel.register_comm_hook``'s contract, with the hook under test (an FSDP extra).

The rules come from PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``
(``test_register_comm_hook``, ``test_registering_hook_non_root``,
``test_registering_hook_hybrid_strategy``, ...): the hook is unset before
registration, registering on the root reaches every FSDP unit, a second
registration and registration on a non-root unit raise, and hybrid sharding
strategies refuse hooks. The rank check is ``fsdp.registration`` (the API's own,
:attr:`conformance.apis.HookApi.checks`), one rule per case.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Dict, List

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from conformance.apis.fsdp.models import build_fsdp
from conformance.apis.fsdp.plan import REGISTRATION_RULES
from conformance.models import get_model
from conformance.protocol import Finding

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

_ALREADY = r"^A communication hook is already registered$"
_NON_ROOT = r"^register_comm_hook can only be called on a root instance.$"
_HYBRID = r"Communication hook is not supported for hybrid strategies"


def _expect_raise(ctx: CheckContext, fn: Callable[[], Any], pattern: str, what: str) -> List[Finding]:
    try:
        fn()
    except AssertionError as exc:
        if re.search(pattern, str(exc)):
            return []
        return [Finding(ctx.rank, f"{what} raised AssertionError({str(exc)!r}), expected a message "
                                  f"matching {pattern!r}")]
    except Exception as exc:  # noqa: BLE001
        return [Finding(ctx.rank, f"{what} raised {type(exc).__name__}({exc}), expected AssertionError "
                                  f"matching {pattern!r}")]
    return [Finding(ctx.rank, f"{what} did not raise; expected AssertionError matching {pattern!r}")]


_HYBRID_GROUPS: Dict[int, Any] = {}


def _hybrid_groups(ctx: CheckContext) -> Any:
    """(intra-node, inter-node) process groups for HYBRID_SHARD without one device per node.

    Every rank shards over the whole pool and replicates over a group of its
    own. With FSDP's default (``process_group=None``) a one-device-per-node
    machine turns HYBRID_SHARD into NO_SHARD and the rule would go untested.
    """
    key = id(ctx.group)
    if key not in _HYBRID_GROUPS:
        singles = [dist.new_group([r]) for r in range(ctx.world_size)]
        _HYBRID_GROUPS[key] = (ctx.group, singles[ctx.rank])
    return _HYBRID_GROUPS[key]


def registration(ctx: CheckContext, spec: HookSpec, *, strategy: str, rule: str) -> List[Finding]:
    """One rule of ``FullyShardedDataParallel.register_comm_hook``, with the hook under test, under ``strategy``
    (the hybrid rule, whose case variant is ``HYBRID``, tries each hybrid strategy itself)."""
    hook = spec.hook
    ctx.phase(f"registration rule {rule}")
    if rule == "hybrid_strategy_raises":
        findings: List[Finding] = []
        for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            base = get_model("net_flat").build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
            model = FSDP(base, process_group=_hybrid_groups(ctx), device_id=ctx.device,
                         sharding_strategy=ShardingStrategy[name],
                         auto_wrap_policy=_linear_wrap_policy())
            if model.sharding_strategy != ShardingStrategy[name]:
                findings.append(Finding(ctx.rank, f"FSDP turned {name} into {model.sharding_strategy.name}; "
                                                  "the hybrid rule could not be exercised"))
                continue
            findings += _expect_raise(ctx, lambda: model.register_comm_hook(spec.state(ctx.group), hook),
                                      _HYBRID, f"register_comm_hook under {name}")
        return findings

    model = build_fsdp("net_wrapped", ctx, strategy, use_orig_params=False)
    units = FSDP.fsdp_modules(model)
    submodules = [m for m in units if not m.check_is_root()]
    state = spec.state(ctx.group)
    if rule == "unset_before_registration":
        return [Finding(ctx.rank, f"FSDP unit {i} has _comm_hook={m._comm_hook!r} before registration")
                for i, m in enumerate(units) if m._comm_hook is not None]
    if rule == "reaches_every_unit":
        model.register_comm_hook(state, hook)
        out = []
        for i, m in enumerate(units):
            if m._comm_hook is not hook or m._comm_hook_state is not state:
                out.append(Finding(ctx.rank, f"FSDP unit {i} of {len(units)} holds hook {m._comm_hook!r} and "
                                             f"state {m._comm_hook_state!r} after registering on the root"))
        return out
    if rule == "second_registration_raises":
        model.register_comm_hook(state, hook)
        return _expect_raise(ctx, lambda: model.register_comm_hook(state, hook), _ALREADY,
                             "a second register_comm_hook")
    if rule == "non_root_raises":
        return _expect_raise(ctx, lambda: submodules[-1].register_comm_hook(state, hook), _NON_ROOT,
                             "register_comm_hook on a non-root FSDP unit")
    if rule == "preset_submodule_raises":
        submodules[-1]._comm_hook = hook
        return _expect_raise(ctx, lambda: model.register_comm_hook(state, hook), _ALREADY,
                             "register_comm_hook with a submodule's hook already set")
    raise ValueError(f"unknown registration rule {rule!r}; known: {', '.join(REGISTRATION_RULES)}")


def _linear_wrap_policy() -> Any:
    return ModuleWrapPolicy({nn.Linear})
