"""The FSDP2 APIs' rank side: a comm's models (:class:`CommModels`) and an all-reduce hook's (:class:`AllReduceHookModels`).

``api="fsdp2"``: the comm is installed with ``FSDPModule.set_custom_reduce_scatter``
on every FSDP module of a model under ``fully_shard`` (:mod:`conformance.apis.fsdp2.build`),
in a config of :data:`conformance.apis.fsdp2.plan.CONFIGS`, through a
:class:`~conformance.apis.fsdp2.recorders.CommRecorder`; the reference is the
same model with no custom comm and the same ``MixedPrecisionPolicy(reduce_dtype=...)``.

``api="fsdp2_all_reduce"``: the hook is installed with ``FSDPModule.set_all_reduce_hook``
on every FSDP module of a native HSDP model (a 2-D replicate x shard mesh),
through a :class:`~conformance.apis.fsdp2.recorders.HookRecorder`; the reference
is native HSDP without it.

Both compare, after each backward, the local shard of every DTensor gradient
(``p.grad.to_local()``), then the full gradient (``p.grad.full_tensor()``,
collective, in the same order on every rank); after the optimizer step, the
local shard of every parameter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.apis.fsdp2.arithmetic import AllReduceHookArithmetic, CommArithmetic
from conformance.apis.fsdp2.build import (apply_config, build_fsdp2, build_replicate, fsdp_modules, hsdp_shape,
                                          mesh_for)
from conformance.apis.fsdp2.standalone import DIVIDE_FACTOR_CONFIGS, HSDP_CONFIGS, divide_factor
from conformance.apis.fsdp2.plan import ALL_REDUCE_CONFIGS, CONFIGS
from conformance.apis.fsdp2.recorders import CommRecorder, HookRecorder, make_comm
from conformance.apis.fsdp2.registration import register_on_every_module
from conformance.ranks.checks.common import View, fqn_without_wrappers, named_grads, named_params
from conformance.models import get_model
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.models import ApiModels, Built, NativeDoesNotHold
from conformance.shared.compare import dtype_name


def full_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``p.grad.full_tensor()`` per FQN: collective, so every rank walks the same parameters in order."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[fqn_without_wrappers(n)] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)
    return out


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``p.full_tensor()`` per FQN (collective, in the same order on every rank)."""
    with torch.no_grad():
        return {fqn_without_wrappers(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for n, p in model.named_parameters()}


#: The gradient view of both APIs: this rank's local shards. Every rank compares its own and the ranks agree
#: (``any_rank``), so equal shards everywhere are equal full gradients: a ``full_tensor()`` of every gradient (an
#: all-gather per parameter and model, every step) would add nothing but its cost.
GRAD_VIEWS = [("local gradient shard", named_grads, "")]
PARAM_VIEW: View = ("local parameter shard after the optimizer step", named_params, "")


@contextlib.contextmanager
def _sync_off(model: nn.Module, setter: str) -> Iterator[None]:
    """``model.<setter>(False)`` on every FSDP module (the setters recurse), back to ``True`` after."""
    getattr(model, setter)(False)
    try:
        yield
    finally:
        getattr(model, setter)(True)


class Fsdp2Models(ApiModels):
    """What both FSDP2 APIs share: the views, the device mesh of ``shape`` (announced, built once per pool),
    and gradient accumulation (``micro_steps`` backward passes per step, all but the last under
    :meth:`no_sync`)."""

    grad_views = GRAD_VIEWS
    param_view = PARAM_VIEW
    #: The ``FSDPModule`` setter that turns synchronisation off for a micro-step: the whole reduction
    #: (``set_requires_gradient_sync``: no reduce-scatter, no comm call; FSDP2 accumulates the unsharded
    #: gradients, in the reduce dtype where one is set) or, under HSDP, its replica all-reduce only
    #: (``set_requires_all_reduce``: the comm is called on every micro-step, the all-reduce hook only on
    #: the last, with the accumulated shards).
    sync_setter = "set_requires_gradient_sync"

    def __init__(self, ctx: Any, spec: Any, model: str, micro_steps: int = 1):
        self.micro_steps = micro_steps
        super().__init__(ctx, spec, model)

    def no_sync(self, model: nn.Module) -> Any:
        """FSDP2's gradient accumulation: ``model.<sync_setter>(False)`` for the micro-step (FSDP2 has no
        ``no_sync()``; ``FSDPModule.set_requires_gradient_sync`` / ``set_requires_all_reduce``)."""
        return _sync_off(model, self.sync_setter)

    def _mesh(self, shape: Tuple[int, ...]) -> Any:
        self.ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
        return mesh_for(self.ctx, shape)

    def full_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return full_grads(model)

    def full_params(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return full_params(model)


#: How far native's gradient may be from the exact reduction, in units of the reduce dtype's epsilon (relative,
#: 2-norm, per parameter): a few roundings (the pre-divide, the SUM, the post-divide), never a lost factor.
ANALYTIC_ULPS = 16


def _divide_factors(model: nn.Module, config: str, world_size: int) -> Dict[str, float]:
    """``{fqn: what FSDP2 divides its gradient's SUM by}``: the divide factor where ``config`` set one on the FSDP
    module holding the parameter (the innermost FSDP module around it), else the shard group's size."""
    units = fsdp_modules(model)
    owners = sorted((name for name, m in model.named_modules() if any(m is u for u in units)), key=len, reverse=True)
    every = DIVIDE_FACTOR_CONFIGS[config] == "every"
    out: Dict[str, float] = {}
    for fqn, _ in model.named_parameters():
        owner = next(o for o in owners if o == "" or fqn.startswith(o + "."))
        out[fqn_without_wrappers(fqn)] = divide_factor(world_size) if every or owner == "" else float(world_size)
    return out


#: What a comm under ``replicate`` tells its author: the case is skipped with it once the training matched.
NEVER_CALLED_UNDER_REPLICATE = (
    "this comm is never called under replicate: replicate (on FSDP2, torch.distributed._composable."
    "replicate_with_fsdp) has no shard group, so FSDP2 allocates its gradient buffers through the comm's allocate "
    "but all-reduces them natively and never calls the comm; set_custom_reduce_scatter does nothing there (the "
    "training equals replicate without it), so register the comm on modules under fully_shard, or reduce in an "
    "all-reduce hook (set_all_reduce_hook)")


class CommModels(Fsdp2Models):
    """A custom reduce-scatter comm's models in ``config``: ``fully_shard`` on a 1-D mesh over the pool (or
    over this rank's data-parallel subgroup for ``subgroup``), or a 2-D mesh for ``hsdp``; the config's divide
    factor or forced SUM on every FSDP module of both models. Under ``replicate``, both models are
    ``replicate`` on FSDP2, where FSDP2 calls the comm's ``allocate`` but never the comm: a case that matches
    ends with :data:`NEVER_CALLED_UNDER_REPLICATE` (kind ``"not_applicable"``).

    Raises:
        ValueError: ``config`` is not one of :data:`~conformance.apis.fsdp2.plan.CONFIGS`.
    """

    def __init__(self, ctx: Any, spec: Any, *, model: str, config: str, micro_steps: int = 1):
        if config not in CONFIGS:
            raise ValueError(f"unknown FSDP2 config {config!r}; known: {', '.join(CONFIGS)}")
        super().__init__(on_subgroup(ctx) if config == "subgroup" else ctx, spec, model, micro_steps)
        self.config = config
        if config in HSDP_CONFIGS:
            self.sync_setter = "set_requires_all_reduce"
        claim = "" if spec.reduce_dtype is None else f" with reduce_dtype={dtype_name(spec.reduce_dtype)}"
        if config == "replicate":
            self.mesh = None  # replicate's own 1-D mesh over the pool
            self.reference = "replicate (on FSDP2) without the comm" + claim
        else:
            shape = hsdp_shape(self.ctx.world_size) if config in HSDP_CONFIGS else (self.ctx.world_size,)
            self.mesh = self._mesh(shape)
            self.reference = "native fully_shard" + claim
        self.arithmetic = CommArithmetic(self.ctx.world_size, spec.reduce_dtype)

    def check_reference(self, model: nn.Module, inputs: Sequence[Tuple[torch.Tensor, ...]], step: int) -> None:
        """Under a divide-factor config, native's full gradients against the exact reduction: the SUM over
        ranks, in float64, of each rank's local gradient (the same parameters and inputs through the plain
        model), divided by the factor of the FSDP module that holds the parameter (the divide factor where
        the config set it, else the shard group's size, FSDP2's own average). The relative error of each
        parameter's gradient (2-norm) may be at most :data:`ANALYTIC_ULPS` units of the reduce dtype's
        epsilon: a rounding, never a lost factor or a zeroed buffer. Collective over the pool's group.

        Raises:
            NativeDoesNotHold: a gradient further off, named with both norms and the bound.
        """
        if self.config not in DIVIDE_FACTOR_CONFIGS:
            return
        ctx = self.ctx
        ctx.phase(f"step {step}: the reference model's analytic check (the exact SUM over ranks / divide factor)")
        params, grads = full_params(model), full_grads(model)
        plain = get_model(self.model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
        with torch.no_grad():
            for name, p in plain.named_parameters():
                p.copy_(params[name])
        for micro in inputs:
            self.loss_fn(micro, plain(*micro)).backward()
        factors = _divide_factors(model, self.config, ctx.world_size)
        eps = torch.finfo(self.spec.reduce_dtype or torch.float32).eps
        for name, p in plain.named_parameters():
            got = grads.get(name)
            if p.grad is None or got is None:
                continue
            exact = p.grad.detach().double()
            dist.all_reduce(exact, group=ctx.group)
            exact /= factors[name]
            off = float((got.double() - exact).norm())
            scale = float(exact.norm())
            if off > ANALYTIC_ULPS * eps * max(scale, 1e-30):
                raise NativeDoesNotHold(
                    f"native's full gradient of {name!r} at step {step} is not the exact SUM over ranks divided "
                    f"by {factors[name]:g} (its FSDP module's divide factor): the difference has 2-norm {off:.3g} "
                    f"against {scale:.3g} for the exact value, beyond {ANALYTIC_ULPS} units of "
                    f"{dtype_name(self.spec.reduce_dtype or torch.float32)}'s epsilon (as NCCL's bfloat16 "
                    "PREMUL_SUM returning zeros, PyTorch issue 190745); this native path cannot judge a hook here")

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        ctx.phase("building the hooked model" if hooked else "building the reference model (native reduce-scatter)")
        reduce_dtype = None if full_precision else self.spec.reduce_dtype
        if self.config == "replicate":
            model = build_replicate(self.model_name, ctx, reduce_dtype=reduce_dtype)
        else:
            model = build_fsdp2(self.model_name, ctx, self.mesh, reduce_dtype=reduce_dtype)
        apply_config(model, self.config, ctx.world_size)
        if not hooked:
            return Built(model)
        recorder = CommRecorder(make_comm(self.spec), ctx.rank,
                                never_called=NEVER_CALLED_UNDER_REPLICATE if self.config == "replicate" else None)
        register_on_every_module(model, "set_custom_reduce_scatter", recorder)
        return Built(model, recorder)


class AllReduceHookModels(Fsdp2Models):
    """An all-reduce hook's models, where FSDP2 calls the hook after its own all-reduce: native HSDP on a 2-D
    (replicate x shard) mesh of the pool (``config="hsdp"``), or ``replicate`` on FSDP2 over the pool
    (``"replicate"``, AVG; ``"replicate_sum"``, ``set_gradient_divide_factor(1.0)``: a SUM, torchtitan's
    default), where the hook gets every module's whole gradient.

    Raises:
        ValueError: ``config`` is not one of :data:`ALL_REDUCE_CONFIGS`.
    """

    sync_setter = "set_requires_all_reduce"

    def __init__(self, ctx: Any, spec: Any, *, model: str, config: str = "hsdp", micro_steps: int = 1):
        if config not in ALL_REDUCE_CONFIGS:
            raise ValueError(f"an all-reduce hook runs under {' or '.join(ALL_REDUCE_CONFIGS)}, not {config!r}")
        super().__init__(ctx, spec, model, micro_steps)
        self.config = config
        if config == "hsdp":
            self.shape = hsdp_shape(ctx.world_size)
            self.mesh = self._mesh(self.shape)
            self.reference = "native HSDP without the hook"
            divisors: Tuple[int, ...] = (self.shape[0], self.shape[1], ctx.world_size)
        else:
            self.shape = (ctx.world_size, 1)
            self.reference = "replicate (on FSDP2) without the hook" + (
                ", set_gradient_divide_factor(1.0)" if config == "replicate_sum" else "")
            divisors = (ctx.world_size,)
        self.arithmetic = AllReduceHookArithmetic(ctx.world_size, None, divisors=divisors,
                                                  native_name="native HSDP" if config == "hsdp" else "replicate")

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        ctx.phase("building the hooked model" if hooked else
                  f"building the reference model ({self.arithmetic.native_name}, no hook)")
        reduce_dtype = None if full_precision else self.spec.reduce_dtype
        if self.config == "hsdp":
            model = build_fsdp2(self.model_name, ctx, self.mesh, reduce_dtype=reduce_dtype)
        else:
            model = build_replicate(self.model_name, ctx, reduce_dtype=reduce_dtype,
                                    divide_factor=1.0 if self.config == "replicate_sum" else None)
        if not hooked:
            return Built(model)
        recorder = HookRecorder(self.spec.hook, ctx.rank, self.shape)
        register_on_every_module(model, "set_all_reduce_hook", recorder)
        return Built(model, recorder)
