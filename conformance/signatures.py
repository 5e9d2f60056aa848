"""Signature helpers for validating a hook against the API it plugs into, and :class:`SpecError`.

Below both :mod:`conformance.spec` (``HookSpec``, which validates each spec against its API
in :data:`conformance.apis.registry.HOOK_APIS`) and the API plans (``conformance/apis/<api>/plan.py``,
whose ``validate`` uses these): neither imports the other through here.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Tuple

__all__ = ["FSDP_STRATEGIES", "SpecError", "binds_signature", "qualname", "signature_text",
           "strategies_from_signature"]

#: FSDP sharding strategies the ``fsdp`` checks run under (names of
#: ``torch.distributed.fsdp.ShardingStrategy`` members).
FSDP_STRATEGIES = ("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP")
_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


class SpecError(ValueError):
    """A hook spec is unusable. The message names the spec and how to fix it."""


def strategies_from_signature(hook: Callable[..., Any]) -> Tuple[str, ...]:
    """Which sharding strategies a hook's signature can serve.

    Mirrors how FSDP calls the hook: ``_reduce_grad_no_shard`` passes
    ``(state, grad)``; ``_reduce_grad`` passes ``(state, grad, output)``.
    A signature Python cannot inspect is assumed to serve all strategies.
    """
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return FSDP_STRATEGIES
    out = []
    if _binds(sig, 2):
        out.append("NO_SHARD")
    if _binds(sig, 3):
        out.extend(_SHARDED)
    return tuple(out)


def binds_signature(fn: Any, nargs: int) -> bool:
    """Whether ``fn`` can be called with ``nargs`` positional arguments (True if not inspectable)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    return _binds(sig, nargs)


def _binds(sig: inspect.Signature, nargs: int) -> bool:
    try:
        sig.bind(*([None] * nargs))
    except TypeError:
        return False
    return True


def qualname(obj: Any) -> str:
    """``module.QualifiedName`` of a hook, for messages."""
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{name}"


def signature_text(obj: Any) -> str:
    """The hook's signature as text, ``(...)`` where Python cannot inspect it."""
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
