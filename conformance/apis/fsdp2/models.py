"""The reduce-scatter comm's rank side: :class:`CommModels`.

The comm is installed with ``FSDPModule.set_custom_reduce_scatter`` on every
FSDP module of a model under ``fully_shard``, in a config of the API's setup
object (:data:`~conformance.apis.fsdp2.standalone.SETUP`), through a
:class:`~conformance.apis.fsdp2.recorder.CommRecorder`; the reference is the
same model with no custom comm and the same ``MixedPrecisionPolicy(reduce_dtype=...)``.
What every FSDP2 API's models share (meshes, builds, views, accumulation) is
:class:`~conformance.apis.fsdp2_common.models.Fsdp2Models`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.apis.fsdp2.arithmetic import CommArithmetic
from conformance.apis.fsdp2.recorder import CommRecorder
from conformance.apis.fsdp2.standalone import SETUP
from conformance.apis.fsdp2_common.models import Fsdp2Models, full_grads, full_params
from conformance.apis.fsdp2_common.registration import REDUCE_SCATTER
from conformance.apis.fsdp2_common.registration_rules import registration_check
from conformance.apis.fsdp2_common.setup import Fsdp2Config
from conformance.apis.fsdp2_common.standalone import fsdp_modules
from conformance.models import get_model
from conformance.shared.standalone_compare import fqn_without_wrappers
from conformance.ranks.checks.models import NativeDoesNotHold, Recorder
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

#: ``fsdp2.registration``: the registration rules of ``set_custom_reduce_scatter`` with the spec's comm (made by
#: its factory, as every check makes it), on a 1-D mesh over the pool (``config="default"``).
registration = registration_check(SETUP, REDUCE_SCATTER)


#: How far native's gradient may be from the exact reduction, in units of the reduce dtype's epsilon (relative,
#: 2-norm, per parameter): a few roundings (the pre-divide, the SUM, the post-divide), never a lost factor.
ANALYTIC_ULPS = 16


def _divide_factors(model: nn.Module, layout: Fsdp2Config, world_size: int) -> Dict[str, float]:
    """``{fqn: what FSDP2 divides its gradient's SUM by}``: the divide factor where ``layout`` set one on the FSDP
    module holding the parameter (the innermost FSDP module around it), else the shard group's size."""
    units = fsdp_modules(model)
    owners = sorted((name for name, m in model.named_modules() if any(m is u for u in units)), key=len, reverse=True)
    out: Dict[str, float] = {}
    for fqn, _ in model.named_parameters():
        owner = next(o for o in owners if o == "" or fqn.startswith(o + "."))
        out[fqn_without_wrappers(fqn)] = (layout.divide_factor(world_size) if not layout.divide_root_only or owner == ""
                                          else float(world_size))
    return out


#: What a comm under ``replicate`` tells its author: the case is skipped with it once the training matched.
NEVER_CALLED_UNDER_REPLICATE = (
    "this comm is never called under replicate: replicate (on FSDP2, torch.distributed._composable."
    "replicate_with_fsdp) has no shard group, so FSDP2 allocates its gradient buffers through the comm's allocate "
    "but all-reduces them natively and never calls the comm; set_custom_reduce_scatter does nothing there (the "
    "training equals replicate without it), so register the comm on modules under fully_shard, or reduce in an "
    "all-reduce hook (set_all_reduce_hook)")


class CommModels(Fsdp2Models):
    """A custom reduce-scatter comm's models in ``config`` (:data:`~conformance.apis.fsdp2.standalone.SETUP`):
    ``fully_shard`` on a 1-D mesh over the pool (or over this rank's data-parallel subgroup for ``subgroup``),
    or a 2-D mesh for ``hsdp``; the config's divide factor or forced SUM on every FSDP module of both models.
    Under ``replicate``, both models are ``replicate`` on FSDP2, where FSDP2 calls the comm's ``allocate`` but
    never the comm: a case that matches ends with :data:`NEVER_CALLED_UNDER_REPLICATE` (kind
    ``"hook_not_called"``).

    Raises:
        ValueError: ``config`` is not one of :data:`~conformance.apis.fsdp2.plan.CONFIGS`.
    """

    setup = SETUP

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str, micro_steps: int = 1):
        super().__init__(ctx, spec, model=model, config=config, micro_steps=micro_steps)
        self.arithmetic = CommArithmetic(self.ctx.world_size, spec.reduce_dtype)

    def recorder(self, hook: Callable[..., object]) -> Recorder:
        never = NEVER_CALLED_UNDER_REPLICATE if self.layout.mesh == "replicate" else None
        return CommRecorder(hook, self.ctx.rank, never_called=never)

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
        if self.layout.divide_factor is None or self.layout.param_dtype is not None:
            return  # under a claimed parameter dtype the plain float32 model computes other gradients
        ctx = self.ctx
        ctx.phase(f"step {step}: the reference model's analytic check (the exact SUM over ranks / divide factor)")
        params, grads = full_params(model), full_grads(model)
        plain = get_model(self.model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
        with torch.no_grad():
            for name, p in plain.named_parameters():
                p.copy_(params[name])
        for micro in inputs:
            self.loss_fn(micro, plain(*micro)).backward()
        factors = _divide_factors(model, self.layout, ctx.world_size)
        eps = torch.finfo(self.spec.reduce_dtype or torch.float32).eps
        for name, p in plain.named_parameters():
            got = grads.get(name)
            if p.grad is None or got is None or getattr(p, "expert", False):
                continue  # an expert's gradient stays local (an FSDP module over its rank alone): no SUM to check
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
