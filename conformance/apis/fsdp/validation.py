"""Which FSDP1 sharding strategies a spec is checked under, from its hook's signature (the FSDP1 API's
``validate``, :mod:`conformance.apis.fsdp.plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

from conformance.signatures import (FSDP_STRATEGIES, SpecError, qualname, refuse_grad_bucket, signature_text,
                                    strategies_from_signature)

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

__all__ = ["validate"]


def validate(spec: HookSpec) -> Tuple[str, ...]:
    """FSDP calls ``hook(state, grad)`` under NO_SHARD and ``hook(state, grad, output)`` when sharded.

    Returns the strategies the spec is checked under: ``spec.strategies``, or
    every one its hook's signature serves. Raises :class:`SpecError` naming
    the strategy and the signature that do not fit.
    """
    refuse_grad_bucket(spec, "fsdp", "hook(state, grad) with a flat gradient tensor")
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
