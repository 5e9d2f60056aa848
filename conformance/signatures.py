"""Signature helpers for validating a hook against the API it plugs into, and :class:`SpecError`.

Below both :mod:`conformance.spec` (``HookSpec``, which validates each spec against its API
in :data:`conformance.apis.registry.HOOK_APIS`) and the API plans (``conformance/apis/<api>/plan.py``,
whose ``validate`` uses these): neither imports the other through here.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

__all__ = ["ALL_GATHER_CALL", "FSDP_STRATEGIES", "REDUCE_SCATTER_CALL", "SpecError", "binds_signature",
           "comm_call_binds", "qualname", "refuse_grad_bucket", "refuse_unfit_comm", "says_grad_bucket",
           "signature_text", "strategies_from_signature"]

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


def binds_signature(fn: Callable[..., object], nargs: int) -> bool:
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


def qualname(obj: object) -> str:
    """``module.QualifiedName`` of a hook, for messages."""
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{name}"


def signature_text(obj: Callable[..., object]) -> str:
    """The hook's signature as text, ``(...)`` where Python cannot inspect it."""
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


#: The keywords FSDP2 calls an all-gather comm with (``foreach_all_gather``: ``all_gather_comm(output_tensor=...,
#: input_tensor=..., group=..., async_op=...)``) and a reduce-scatter comm with (``foreach_reduce``:
#: ``reduce_scatter_comm(output_tensor=..., input_tensor=..., group=..., op=...)``), torch 2.13.
ALL_GATHER_CALL = ("output_tensor", "input_tensor", "group", "async_op")
REDUCE_SCATTER_CALL = ("output_tensor", "input_tensor", "group", "op")


def comm_call_binds(comm: Any, keywords: Tuple[str, ...]) -> Optional[bool]:  # Any: the user's comm, class or object
    """Whether an FSDP2 comm (an object with ``allocate``, or a class, which the suite calls with no arguments to
    make one) takes ``__call__(**keywords)``, as FSDP2 calls it; ``None`` where that cannot be known (a factory
    function, a signature Python cannot inspect): never a reason to refuse a spec."""
    if isinstance(comm, type):
        if not any("__call__" in vars(klass) for klass in comm.__mro__ if klass is not object):
            return None
        target, leading = comm.__call__, (None,)  # the function, self first
    elif callable(getattr(comm, "allocate", None)):
        target, leading = comm, ()
    else:
        return None
    try:
        inspect.signature(target).bind(*leading, **{k: None for k in keywords})
    except TypeError:
        return False
    except ValueError:
        return None
    return True


def says_grad_bucket(hook: Callable[..., object]) -> bool:
    """Whether ``hook`` says it takes DDP's ``GradBucket``: a parameter annotated ``dist.GradBucket`` (PyTorch's own
    DDP hooks are annotated so); annotations as strings (``from __future__ import annotations``) count by their
    words. A returned ``Future`` alone says nothing: other APIs' hooks may return one."""
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return False
    return any(p.annotation is not inspect.Parameter.empty and "GradBucket" in str(p.annotation)
               for p in sig.parameters.values())


def refuse_unfit_comm(spec: HookSpec, api: str, call: Tuple[str, ...], other_api: str, other_call: Tuple[str, ...],
                      other_note: str) -> None:
    """Raise :class:`SpecError` where ``spec``'s FSDP2 comm cannot take ``__call__(**call)``, as FSDP2 calls it under
    ``api`` (:func:`comm_call_binds` is ``False``), naming ``other_api`` (``other_note``: why) where it takes
    ``other_call`` instead."""
    if comm_call_binds(spec.hook, call) is False:
        other = f" It fits api='{other_api}' ({other_note})" if comm_call_binds(spec.hook, other_call) else ""
        keywords = ", ".join(f"{k}=..." for k in call)
        raise SpecError(f"HookSpec {spec.name!r}: for api='{api}' FSDP2 calls the comm as comm({keywords}), which "
                        f"{qualname(spec.hook)}.__call__{signature_text(spec.hook.__call__)} cannot take.{other}")


def refuse_grad_bucket(spec: HookSpec, api: str, called: str) -> None:
    """Raise :class:`SpecError` where ``spec``'s hook says it takes DDP's ``GradBucket`` (:func:`says_grad_bucket`)
    but ``api`` calls it as ``called`` (``"hook(state, grad) with a flat gradient tensor"``): it fits api='ddp'."""
    if says_grad_bucket(spec.hook):
        raise SpecError(f"HookSpec {spec.name!r}: api='{api}' calls {called}, but {qualname(spec.hook)}"
                        f"{signature_text(spec.hook)} says it takes DDP's GradBucket (its annotations): it fits "
                        "api='ddp' (DistributedDataParallel.register_comm_hook)")
