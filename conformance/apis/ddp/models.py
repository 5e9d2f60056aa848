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
(``find_unused_parameters=True`` on a model that leaves parameters unused),
``no_sync`` (gradient accumulation under ``no_sync()`` before a synchronising step)
and ``compiled_autograd`` (DDP's python reducer under ``torch.compile`` and compiled
autograd, :mod:`conformance.apis.ddp.compiled`: the hook is called as
``hook(state, (grad, param))`` per parameter, and the reference is that DDP with
no hook, ``param.grad / world_size`` then SUM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Optional

import torch
from torch import nn

from conformance.apis.ddp.arithmetic import BatchedDdpArithmetic, CompiledDdpArithmetic, DdpArithmetic
from conformance.apis.ddp.compiled import (COMPILED_REFERENCE, CompiledHookRecorder, CompiledTraining,
                                           compiled_ddp_missing)
from conformance.apis.ddp.cpp_hooks import is_cpp_hook
from conformance.apis.ddp.recorder import CppHookRecorder, DDPHookRecorder
from conformance.apis.ddp.native_modes import divides
from conformance.apis.ddp.reference import reference_name
from conformance.apis.ddp.standalone import (ALL_CONFIGS, COMPILED_CONFIG, in_param_dtype, micro_steps, reference_hook,
                                             wrap_ddp)
from conformance.models import get_model
from conformance.ranks import hook_code
from conformance.ranks.checks.common import named_grads, named_params, train_step
from conformance.shared.standalone_compare import fqn_inside_ddp
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.models import ApiModels, Built
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec


def build_ddp(model_name: str, ctx: CheckContext, config: str, param_dtype: Optional[torch.dtype] = None, *,
              batched: bool = False) -> nn.Module:
    """``DistributedDataParallel`` around a freshly built ``model_name`` under ``config``, in ``ctx.group``; in
    ``param_dtype`` where given (:func:`~conformance.apis.ddp.standalone.in_param_dtype`); with
    ``batched_grad_copy=True`` added to the config's options where ``batched`` (the case's native is DDP's
    batched copy: :func:`~conformance.apis.ddp.native_modes.divides`).

    Raises:
        ValueError: ``config`` is not one of :data:`ALL_CONFIGS`.
    """
    if config not in ALL_CONFIGS:
        raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(ALL_CONFIGS)}")
    module = get_model(model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    return wrap_ddp(in_param_dtype(module, param_dtype), ctx.group, ctx.device, config, batched=batched)


def ddp_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``{fqn: gradient}`` in the wrapped model's FQNs (DDP's leading ``module.`` removed)."""
    return named_grads(model, fqn_inside_ddp)


def ddp_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``{fqn: parameter}`` in the wrapped model's FQNs."""
    return named_params(model, fqn_inside_ddp)


class DdpModels(ApiModels):
    """DDP models of a case in ``config`` (:data:`ALL_CONFIGS`); DDP does not shard, so every view is whole.

    The hook's state is ``spec.state(ctx.group)``; with ``config="subgroup"`` both models and the state are
    on this rank's data-parallel subgroup (:func:`~conformance.ranks.checks.groups.on_subgroup`). The
    ``no_sync`` config runs :data:`NO_SYNC_MICRO_STEPS` backward passes per step. Under ``compiled_autograd``
    both models are DDP's python reducer, trained by one compiled step (:attr:`compiled`), the hook registered
    bare and recorded after the fact (:class:`~conformance.apis.ddp.compiled.CompiledHookRecorder`), and the
    native is :class:`~conformance.apis.ddp.arithmetic.CompiledDdpArithmetic`.

    Attributes:
        compiled: the case's compiled training step under ``compiled_autograd``, else ``None``.
    """

    grad_views = [("gradient", ddp_grads, "")]
    param_view = ("parameter after the optimizer step", ddp_params, "")

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str):
        if config not in ALL_CONFIGS:
            raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(ALL_CONFIGS)}")
        self.config = config
        self.micro_steps = micro_steps({"config": config}, 1)
        super().__init__(on_subgroup(ctx) if config == "subgroup" else ctx, spec, model)
        self.reference = reference_name(spec)
        if spec.param_dtype is not None:
            self.reference += f", the model in {dtype_name(spec.param_dtype)}"
        # The reference of reference_hook for float32 parameters: a float32 claim is DDP with no hook.
        claim = None if spec.reduce_dtype in (None, spec.param_dtype or torch.float32) else spec.reduce_dtype
        self.arithmetic = DdpArithmetic(self.ctx.world_size, claim)
        self.compiled: Optional[CompiledTraining] = None
        self.batched = divides(config, spec)  # DDP(batched_grad_copy=True): the config's, or the spec's native
        if self.batched and claim is None:
            self.reference = self.reference.replace("DDP with no hook", "DDP with batched_grad_copy=True and no hook")
            self.arithmetic = BatchedDdpArithmetic(self.ctx.world_size, None)
        if config == COMPILED_CONFIG:
            self.reference = COMPILED_REFERENCE
            self.arithmetic = CompiledDdpArithmetic(self.ctx.world_size, None)

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        noun = self.noun if self.model_name == "analytic_linear" else f"DDP {self.noun}"
        ctx.phase(f"building the {'hooked' if hooked else 'reference'} {noun}")
        if self.config == COMPILED_CONFIG:
            return self._build_compiled(hooked)
        model = build_ddp(self.model_name, ctx, self.config, None if full_precision else self.spec.param_dtype,
                          batched=self.batched)
        if hooked and is_cpp_hook(self.spec):
            model._register_builtin_comm_hook(self.spec.hook.hook_type())
            return Built(model, CppHookRecorder(self.spec.hook, model))
        if hooked:
            names = {id(p): fqn_inside_ddp(n) for n, p in model.named_parameters()}
            recorder = DDPHookRecorder(self.spec.hook, ctx.rank, names)
            model.register_comm_hook(hook_code.state_of(self.spec, ctx.group), recorder)
            return Built(model, recorder)
        ref = None if full_precision else reference_hook(self.spec.reduce_dtype, next(model.parameters()).dtype)
        if ref is not None:
            state_factory, hook = ref
            model.register_comm_hook(state_factory(ctx.group), hook)
        return Built(model)

    def _build_compiled(self, hooked: bool) -> Built:
        """A ``compiled_autograd`` model: the reference with no hook, or the hook registered bare, as DDP's
        ``register_comm_hook`` takes it (a registration it refuses becomes the recorder's finding).

        Raises:
            RuntimeError: this torch cannot train DDP under compiled autograd
                (:func:`~conformance.apis.ddp.compiled.compiled_ddp_missing`); raised while the reference is
                built, so the case is skipped with the reason (the reference replayed alone fails too).
        """
        if self.compiled is None:
            missing = compiled_ddp_missing()
            if missing is not None:
                raise RuntimeError(f"compiled DDP cannot run here: {missing}")
            self.compiled = CompiledTraining()
        model = build_ddp(self.model_name, self.ctx, self.config, self.spec.param_dtype)
        if not hooked:
            return Built(model)
        recorder = CompiledHookRecorder(self.spec.hook, self.ctx, model, self.model_name, self.inputs, self.loss_fn)
        try:
            model.register_comm_hook(self.spec.state(self.ctx.group), self.spec.hook)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            recorder.refuse(exc)
        return Built(model, recorder)

    @property
    def train_step(self) -> Callable[..., None]:
        """:func:`~conformance.ranks.checks.common.train_step`; under ``compiled_autograd``, compiled
        (:meth:`CompiledTraining.train_step <conformance.apis.ddp.compiled.CompiledTraining.train_step>`)."""
        return train_step if self.compiled is None else self.compiled.train_step

    def local_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return ddp_grads(model)

    def full_params(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return ddp_params(model)

    def forward(self, model: nn.Module) -> nn.Module:
        return model.module

    def reference_average(self, hooked: nn.Module) -> Optional[str]:
        """Under a reduced-precision claim, the documented equivalent's average (its own rounding)."""
        if self.config == COMPILED_CONFIG or reference_hook(self.spec.reduce_dtype,
                                                            next(hooked.parameters()).dtype) is None:
            return None
        return f"the {dtype_name(self.spec.reduce_dtype)} average as {reference_name(self.spec)} computes it"
