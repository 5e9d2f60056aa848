"""The rank side every FSDP2 API shares: :class:`Fsdp2Models`, built from the API's setup object.

An API's models (``conformance/apis/<api>/models.py``) subclass
:class:`Fsdp2Models` with its ``setup``
(:class:`~conformance.apis.fsdp2_common.setup.Fsdp2Setup`, the object its
reproducers read too), its recorder and its native arithmetic. Here, from the
case's config: the device mesh (announced, built once per pool), the
reference's text, both models (:func:`~conformance.apis.fsdp2_common.build.build_model`),
the hook bound as ``setup.bind`` says and registered with ``setup.setter`` on
every FSDP module through the API's recorder, and gradient accumulation
(the config's ``sync_setter``).

Every FSDP2 API compares, after each backward, the local shard of every DTensor
gradient (``p.grad.to_local()``); after the optimizer step, the local shard of
every parameter; the full tensors (collective, in the same order on every rank)
where a check needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from conformance.apis.fsdp2_common.build import build_model, mesh_for
from conformance.apis.fsdp2_common.registration import register_on_every_module
from conformance.apis.fsdp2_common.setup import Fsdp2Config, Fsdp2Setup
from conformance.ranks import hook_code
from conformance.ranks.checks.common import View, named_grads, named_params
from conformance.shared.standalone_compare import fqn_without_wrappers
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.models import ApiModels, Built, Recorder
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec


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


#: The gradient view of every FSDP2 API: this rank's local shards. Every rank compares its own and the ranks agree
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
    """An FSDP2 API's models in ``config``, as its :attr:`setup` says.

    Args:
        ctx, spec, model: as :class:`~conformance.ranks.checks.models.ApiModels` (a ``"subgroup"`` mesh trains
            on this rank's data-parallel subgroup, :func:`~conformance.ranks.checks.groups.on_subgroup`).
        config: one of ``setup.configs``.
        micro_steps: backward passes per step, all but the last under :meth:`no_sync`.

    Attributes (besides :class:`~conformance.ranks.checks.models.ApiModels`'): ``layout`` (the config's
    :class:`~conformance.apis.fsdp2_common.setup.Fsdp2Config`), ``shape`` (its mesh's shape; ``None`` under
    ``replicate``), ``mesh`` (the device mesh, or ``None``).

    Raises:
        ValueError: ``config`` is not one of the setup's; the pool does not fit its mesh.
    """

    #: The API's setup object.
    setup: ClassVar[Fsdp2Setup]
    grad_views = GRAD_VIEWS
    param_view = PARAM_VIEW

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str, micro_steps: int = 1):
        if config not in self.setup.configs:
            raise ValueError(f"unknown config {config!r} for a hook installed with FSDPModule.{self.setup.setter}; "
                             f"known: {', '.join(self.setup.configs)}")
        self.layout: Fsdp2Config = self.setup.configs[config]
        if spec.param_dtype is not None:  # both models train in the claimed parameter dtype
            self.layout = dataclasses.replace(self.layout, param_dtype=spec.param_dtype)
        self.micro_steps = micro_steps
        super().__init__(on_subgroup(ctx) if self.layout.mesh == "subgroup" else ctx, spec, model)
        self.config = config
        self.shape: Optional[Tuple[int, ...]] = self.layout.shape(self.ctx.world_size)
        self.mesh = None if self.shape is None else self._mesh(self.shape)
        claim = None if spec.reduce_dtype is None else dtype_name(spec.reduce_dtype)
        self.reference = self.setup.reference(config, self.ctx.world_size, claim)
        if spec.param_dtype is not None:
            self.reference += f" and param_dtype={dtype_name(spec.param_dtype)}"

    def _mesh(self, shape: Tuple[int, ...]) -> Any:
        self.ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
        return mesh_for(self.ctx, shape)

    def no_sync(self, model: nn.Module) -> Any:
        """FSDP2's gradient accumulation: ``model.<sync_setter>(False)`` for the micro-step (FSDP2 has no
        ``no_sync()``; the config's ``set_requires_gradient_sync`` or ``set_requires_all_reduce``); nothing on a
        reference built to synchronise every micro-batch (``Fsdp2Config.sync_hooked_only``)."""
        if getattr(model, "conformance_syncs_always", False):
            return contextlib.nullcontext()
        return _sync_off(model, self.layout.sync_setter)

    def full_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return full_grads(model)

    def full_params(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return full_params(model)

    def recorder(self, hook: Callable[..., object]) -> Recorder:
        """The API's recorder around ``hook`` (the object ``setup.bind`` made), which FSDP2 is given."""
        raise NotImplementedError

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        """The reference (native, no hook) or the hooked model: the setter on every FSDP module, with the
        API's recorder around the bound hook
        (:func:`~conformance.apis.fsdp2_common.registration.register_on_every_module`)."""
        ctx = self.ctx
        ctx.phase(f"building the hooked model (FSDPModule.{self.setup.setter} on every FSDP module)" if hooked else
                  f"building the reference model ({self.reference})")
        reduce_dtype = None if full_precision else self.spec.reduce_dtype
        layout = self.setup.configs[self.config] if full_precision else self.layout  # no claimed dtype either
        model = build_model(ctx, layout, self.model_name, self.mesh, reduce_dtype=reduce_dtype, hooked=hooked)
        if not hooked:
            return Built(model)
        with hook_code.running(self.spec.hook):  # a comm factory and the state factory are the hook's code too
            bound = self.setup.bound(self.spec.hook, self.spec.state, self.spec.name, self.mesh)
        recorder = self.recorder(bound)
        register_on_every_module(model, self.setup.setter, recorder)
        return Built(model, recorder)
