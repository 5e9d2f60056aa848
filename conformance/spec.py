"""The plug-in contract: :class:`HookSpec`, one hook under test and what it claims.

A spec names a hook, the data-parallel API it plugs into, how to build its
state on each rank, and its claim about numerics. The suite checks the claim:

* ``reduce_dtype=None``: the hook reproduces the native full-precision
  averaging bit for bit (FSDP: ``_reduce_grad`` / ``_reduce_grad_no_shard``
  with no hook registered).
* ``reduce_dtype=X``: the hook reproduces FSDP's native
  ``MixedPrecision(reduce_dtype=X)`` bit for bit, and hands back gradients in
  the parameter dtype.

Specs are loaded by the controller and again inside every rank process, so a
spec must be importable by module path (``pkg.module:ATTR``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable, FrozenSet, Optional, Tuple

import torch

__all__ = [
    "APIS",
    "FSDP_STRATEGIES",
    "HookSpec",
    "SpecError",
]

#: Hook APIs the suite knows. ``fsdp``: ``FullyShardedDataParallel.register_comm_hook``.
APIS = ("fsdp",)

#: FSDP sharding strategies the ``fsdp`` checks run under (names of
#: ``torch.distributed.fsdp.ShardingStrategy`` members).
FSDP_STRATEGIES = ("NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP")
_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")

#: Spec names become part of every test id, so they are kept to characters that
#: survive in pytest ids, ``-k`` expressions and JUnit XML unchanged.
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")

_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SpecError(ValueError):
    """A hook spec is unusable. The message names the spec and how to fix it."""


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """One gradient communication hook under test.

    Args:
        name: unique name; appears in every test id of this hook. Letters,
            digits, ``_`` and ``.``; must not start with a digit.
        api: ``"fsdp"``: installed with
            ``FullyShardedDataParallel.register_comm_hook(state, hook)``.
        hook: the hook callable. For ``api="fsdp"``: ``hook(state, grad)`` for
            ``NO_SHARD`` (``grad``: the flat, unsharded gradient of one FSDP
            unit, 1-D, reduced in place) and ``hook(state, grad, output)`` for
            ``FULL_SHARD``/``SHARD_GRAD_OP`` (``grad``: padded flat unsharded
            gradient, 1-D, ``world_size * shard_numel`` elements; ``output``:
            the 1-D shard the hook must fill). A callable object works too.
        state: called on each rank as ``state(process_group)``; returns the
            hook's state object (for example
            ``torch.distributed.algorithms._comm_hooks.default_hooks.DefaultState``).
            A fresh state is built for every model the suite trains.
        reduce_dtype: the claim. ``None``: full-precision default averaging.
            ``torch.float16``/``torch.bfloat16``/...: equals FSDP's
            ``MixedPrecision(reduce_dtype=reduce_dtype)`` with no hook.
        strategies: sharding strategies to check (names of
            ``ShardingStrategy`` members). ``None`` derives them from the
            hook's signature: a hook that accepts ``(state, grad)`` runs under
            ``NO_SHARD``, one that accepts ``(state, grad, output)`` under the
            sharded strategies.
        description: one line shown in the report header.

    Raises:
        SpecError: on construction, for a bad name, an unknown api, a hook
            that is not callable or whose signature fits no strategy, a state
            factory that is not callable, an unsupported reduce dtype or an
            unknown strategy.
    """

    name: str
    api: str
    hook: Callable[..., Any]
    state: Callable[[Any], Any]
    reduce_dtype: Optional[torch.dtype] = None
    strategies: Optional[Tuple[str, ...]] = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise SpecError(
                f"HookSpec name {self.name!r} is not usable in test ids: use letters, "
                "digits, '_' and '.', not starting with a digit (e.g. 'my_fp16_hook')"
            )
        if self.api not in APIS:
            raise SpecError(
                f"HookSpec {self.name!r}: unknown api {self.api!r}; expected one of {', '.join(APIS)}"
            )
        if not callable(self.hook):
            raise SpecError(
                f"HookSpec {self.name!r}: hook {self.hook!r} is not callable; pass the hook "
                "function (or an object with __call__), not the result of calling it"
            )
        if not callable(self.state):
            raise SpecError(
                f"HookSpec {self.name!r}: state {self.state!r} is not callable; pass a factory "
                "called as state(process_group), e.g. DefaultState"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in _REDUCE_DTYPES:
            raise SpecError(
                f"HookSpec {self.name!r}: reduce_dtype {self.reduce_dtype!r} is not a floating "
                "dtype FSDP can reduce in; use None, torch.float16, torch.bfloat16, torch.float32 or torch.float64"
            )
        supported = _strategies_from_signature(self.hook)
        if not supported:
            raise SpecError(
                f"HookSpec {self.name!r}: hook {_qualname(self.hook)}{_signature_text(self.hook)} "
                "accepts neither (state, grad) for NO_SHARD nor (state, grad, output) for "
                "sharded strategies"
            )
        if self.strategies is None:
            object.__setattr__(self, "strategies", supported)
        else:
            strategies = (self.strategies,) if isinstance(self.strategies, str) else tuple(self.strategies)
            unknown = [s for s in strategies if s not in FSDP_STRATEGIES]
            if unknown or not strategies:
                raise SpecError(
                    f"HookSpec {self.name!r}: unknown strategies {unknown or strategies!r}; "
                    f"expected names from {', '.join(FSDP_STRATEGIES)}"
                )
            unfit = [s for s in strategies if s not in supported]
            if unfit:
                raise SpecError(
                    f"HookSpec {self.name!r}: strategies {unfit} need a hook signature of "
                    f"{'(state, grad)' if 'NO_SHARD' in unfit else '(state, grad, output)'}, but the "
                    f"hook is {_qualname(self.hook)}{_signature_text(self.hook)}"
                )
            object.__setattr__(self, "strategies", strategies)

    @property
    def reduce_dtype_name(self) -> str:
        """``"full"`` for the full-precision claim, else the dtype's short name."""
        if self.reduce_dtype is None:
            return "full"
        return str(self.reduce_dtype).replace("torch.", "")


def _strategies_from_signature(hook: Callable[..., Any]) -> Tuple[str, ...]:
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


def _binds(sig: inspect.Signature, nargs: int) -> bool:
    try:
        sig.bind(*([None] * nargs))
    except TypeError:
        return False
    return True


def _qualname(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{name}"


def _signature_text(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def strategy_names(spec: HookSpec) -> FrozenSet[str]:
    """The strategies ``spec`` is checked under, as a set of names."""
    return frozenset(spec.strategies or ())
