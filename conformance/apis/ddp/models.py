"""The DDP API's rank side: its models (:class:`DdpModels`) in each training config.

DDP calls ``hook(state, bucket)`` once per gradient bucket of a synchronising
backward; the hook returns a ``torch.futures.Future`` whose value is the
bucket's new contents, which DDP copies back into the parameters' gradients.
:class:`DdpModels` wraps DDP around a freshly built reference model (plain
module, same seed on every rank) in the pool's process group (or a
data-parallel subgroup), the hook through its future-contract recorder
(:class:`conformance.apis.ddp.future.DDPHookRecorder`).

The reference for each claim (:mod:`conformance.apis.ddp.reference`): DDP with
no hook (``Reducer``: copy the gradient into the bucket multiplied by
``1/world_size``, SUM all-reduce), or for ``reduce_dtype=float16/bfloat16`` the
documented equivalent ``fp16_compress_wrapper(allreduce_hook)`` /
``bf16_compress_wrapper(allreduce_hook)``.

Training configurations (``config``, :data:`CONFIGS`): ``default``,
``small_buckets`` (a bucket cap that forces several buckets), ``bucket_per_param``
(a bucket per parameter, of uneven lengths), ``subgroup`` (DDP, and the hook's
state, on a data-parallel subgroup of the pool, not WORLD), ``bucket_view``
(``gradient_as_bucket_view=True``), ``static_graph``, ``find_unused``
(``find_unused_parameters=True`` on a model that leaves parameters unused) and
``no_sync`` (gradient accumulation under ``no_sync()`` before a synchronising step).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from conformance.apis.ddp.arithmetic import DdpArithmetic
from conformance.apis.ddp.cpp_hooks import is_cpp_hook
from conformance.apis.ddp.recorder import CppHookRecorder, DDPHookRecorder
from conformance.apis.ddp.reference import reference_hook, reference_name
# The configs live in the API's standalone part, which reproducers copy as it is; imported from here too.
from conformance.apis.ddp.standalone import (BUCKET_PER_PARAM_CAP_MB, CONFIGS, NO_SYNC_MICRO_STEPS,  # noqa: F401
                                             SMALL_BUCKET_CAP_MB, micro_steps, wrap_ddp)
from conformance.models import get_model
from conformance.ranks.checks.common import fqn_inside_ddp, named_grads, named_params
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.models import ApiModels, Built
from conformance.ranks.compare import dtype_name

def build_ddp(model_name: str, ctx: Any, config: str) -> nn.Module:
    """``DistributedDataParallel`` around a freshly built ``model_name`` under ``config``, in ``ctx.group``.

    Raises:
        ValueError: ``config`` is not one of :data:`CONFIGS`.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(CONFIGS)}")
    module = get_model(model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    return wrap_ddp(module, ctx.group, ctx.device, config)


def ddp_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``{fqn: gradient}`` in the wrapped model's FQNs (DDP's leading ``module.`` removed)."""
    return named_grads(model, fqn_inside_ddp)


def ddp_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``{fqn: parameter}`` in the wrapped model's FQNs."""
    return named_params(model, fqn_inside_ddp)


class DdpModels(ApiModels):
    """DDP models of a case in ``config`` (:data:`CONFIGS`); DDP does not shard, so every view is whole.

    The hook's state is ``spec.state(ctx.group)``; with ``config="subgroup"`` both models and the state are
    on this rank's data-parallel subgroup (:func:`~conformance.ranks.checks.groups.on_subgroup`). The
    ``no_sync`` config runs :data:`NO_SYNC_MICRO_STEPS` backward passes per step.
    """

    grad_views = [("gradient", ddp_grads, "")]
    param_view = ("parameter after the optimizer step", ddp_params, "")

    def __init__(self, ctx: Any, spec: Any, *, model: str, config: str):
        if config not in CONFIGS:
            raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(CONFIGS)}")
        self.config = config
        self.micro_steps = micro_steps({"config": config}, 1)
        super().__init__(on_subgroup(ctx) if config == "subgroup" else ctx, spec, model)
        self.reference = reference_name(spec)
        # The reference of reference_hook for float32 parameters: a float32 claim is DDP with no hook.
        claim = None if spec.reduce_dtype in (None, torch.float32) else spec.reduce_dtype
        self.arithmetic = DdpArithmetic(self.ctx.world_size, claim)

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        noun = self.noun if self.model_name == "analytic_linear" else f"DDP {self.noun}"
        ctx.phase(f"building the {'hooked' if hooked else 'reference'} {noun}")
        model = build_ddp(self.model_name, ctx, self.config)
        if hooked and is_cpp_hook(self.spec):
            model._register_builtin_comm_hook(self.spec.hook.hook_type())
            return Built(model, CppHookRecorder(self.spec.hook))
        if hooked:
            names = {id(p): fqn_inside_ddp(n) for n, p in model.named_parameters()}
            recorder = DDPHookRecorder(self.spec.hook, ctx.rank, names)
            model.register_comm_hook(self.spec.state(ctx.group), recorder)
            return Built(model, recorder)
        ref = None if full_precision else reference_hook(self.spec.reduce_dtype, next(model.parameters()).dtype)
        if ref is not None:
            state_factory, hook = ref
            model.register_comm_hook(state_factory(ctx.group), hook)
        return Built(model)

    def local_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return ddp_grads(model)

    def full_params(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return ddp_params(model)

    def forward(self, model: nn.Module) -> nn.Module:
        return model.module

    def reference_average(self, hooked: nn.Module) -> Optional[str]:
        """Under a reduced-precision claim, the documented equivalent's average (its own rounding)."""
        if reference_hook(self.spec.reduce_dtype, next(hooked.parameters()).dtype) is None:
            return None
        return f"the {dtype_name(self.spec.reduce_dtype)} average as {reference_name(self.spec)} computes it"
