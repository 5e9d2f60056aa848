"""FSDP1's part of a standalone reproducer (torch only): its native mixed precision and its build.

A reproducer of an FSDP1 case holds what the case runs of this module
(:mod:`conformance.reproducers.sources`: an ``if`` on ``CASE`` as the branch the case takes); the suite's models (``models.py``) import its
mixed-precision settings from here, so the file builds the models as the
suite did: the model's FSDP units, ``use_orig_params=True``, the case's
``ShardingStrategy``, the reference under ``MixedPrecision(reduce_dtype=...)``
for a reduced-precision claim and the hooked model without it (the hook
reduces), both under the low-precision-gradients setting where the case has it.
Its reproducer functions read the globals ``CASE``, ``MODEL``, ``HOOK`` and
``STATE`` only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

if TYPE_CHECKING:  # pragma: no cover - the loop's type; a reproducer defines it (standalone_main.py)
    from conformance.shared.standalone_main import Ranks


def native_mixed_precision(reduce_dtype: Optional[torch.dtype],
                           param_dtype: Optional[torch.dtype] = None) -> Optional[MixedPrecision]:
    """``MixedPrecision(reduce_dtype=X)``, the native path a ``reduce_dtype=X`` hook must equal; with a claimed
    ``param_dtype=P``, ``MixedPrecision(param_dtype=P, reduce_dtype=X)`` (FSDP reduces in ``P`` where ``X`` is
    ``None``), which the hooked model trains under too.

    ``_module_classes_to_ignore`` is emptied: by default FSDP puts batch-norm
    modules in their own FSDP units that reduce in full precision, which
    changes the unit structure between the reference and the hooked model and
    is not something a communication hook can (or should) reproduce.
    """
    if reduce_dtype is None and param_dtype is None:
        return None
    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if hasattr(mp, "_module_classes_to_ignore"):
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, _module_classes_to_ignore=())
    return mp


def low_precision_grads_mixed_precision() -> MixedPrecision:
    """``MixedPrecision(param_dtype=float16, reduce_dtype=float16, keep_low_precision_grads=True)``, the setting of
    ``test_low_precision_grads`` in PyTorch's test_fsdp_clip_grad_norm.py: forward and backward in float16,
    the gradients kept in float16 after the reduction.

    ``reduce_dtype`` is float16, as there (the plan skips hooks that claim another); the reduction of a hook
    that claims none, which keeps its input's dtype, is float16 too. The reference and the hooked model get
    the same setting: FSDP casts the gradient to ``reduce_dtype`` before it calls a hook.
    """
    kw: Dict[str, Any] = dict(param_dtype=torch.float16, keep_low_precision_grads=True, reduce_dtype=torch.float16)
    try:
        return MixedPrecision(**kw, _module_classes_to_ignore=())
    except TypeError:
        return MixedPrecision(**kw)


# -- the reproducer's side (reads its globals when called) ---------------------------------------------------

def reference(case: Dict[str, Any]) -> str:
    """What the hooked copy of ``case`` (a reproducer's ``CASE``) is compared with: FSDP with no hook, under the
    claim's ``MixedPrecision``."""
    if case.get("param_dtype") is not None:
        return (f"the native path with MixedPrecision(param_dtype={case['param_dtype']}, "
                f"reduce_dtype={case['reduce_dtype']})")
    if case["reduce_dtype"] is None:
        return "the native path"
    return f"the native path with MixedPrecision(reduce_dtype={case['reduce_dtype']})"


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: ``REFERENCE`` (:func:`reference`)."""
    return {"REFERENCE": reference(case)}


def subgroup(ranks: Ranks) -> Ranks:
    """A ``subgroup`` case trains in this rank's data-parallel subgroup."""
    if CASE["variant"].get("subgroup"):
        return on_data_parallel_subgroup(ranks)
    return ranks


def case_mixed_precision(hooked: bool) -> Optional[MixedPrecision]:
    """The case's ``MixedPrecision``: the low-precision-gradients setting where the case has it, else the claimed
    ``param_dtype``'s on both copies, else the claim's ``MixedPrecision(reduce_dtype=...)`` on the native copy
    alone (the hook reduces), else none."""
    if CASE["variant"].get("low_precision_grads"):
        return low_precision_grads_mixed_precision()
    if CASE.get("param_dtype") is not None:
        return native_mixed_precision(CASE["reduce_dtype"], CASE["param_dtype"])
    if CASE["reduce_dtype"] is not None:
        return None if hooked else native_mixed_precision(CASE["reduce_dtype"])
    return None


def build(ranks: Ranks, hooked: bool) -> nn.Module:
    """The case's FSDP model under its strategy: with ``hooked``, ``register_comm_hook(STATE(group), HOOK)``; the
    native copy under the claim's ``MixedPrecision(reduce_dtype=...)``, the hooked one without it (the hook
    reduces); both under the low-precision-gradients setting where the case has it."""
    model = MODEL.build_fsdp(group=ranks.group, device=ranks.device, fsdp_kwargs=dict(
        sharding_strategy=ShardingStrategy[CASE["variant"]["strategy"]], mixed_precision=case_mixed_precision(hooked),
        use_orig_params=True))
    if hooked:
        model.register_comm_hook(STATE(ranks.group), HOOK)
    return model


def no_sync(model: nn.Module) -> Any:
    """``FullyShardedDataParallel.no_sync()``."""
    return model.no_sync()


GRADIENT, PARAMETER = "gradient", "parameter after the optimizer step"


def tensors(model: nn.Module, what: str) -> Dict[str, Any]:
    """``{FQN: tensor}`` of ``model`` (FQNs less the ``_fsdp_wrapped_module.`` FSDP inserts: the rank side's
    ``fqn_without_wrappers`` for a model of no other wrapper): each parameter's gradient (``GRADIENT``) or the
    parameter itself (``PARAMETER``); ``use_orig_params=True`` keeps them unflattened."""
    return {n.replace("_fsdp_wrapped_module.", ""): p.grad if what == GRADIENT else p
            for n, p in model.named_parameters()}
