"""Reference models for the conformance checks.

Each model is a :class:`~conformance.models.base.ReferenceModel` subclass registered in
:data:`MODELS` under its ``name`` (FSDP units: ``fsdp_units``, root included,
with no ``auto_wrap_policy``/``mixed_precision`` in ``fsdp_kwargs``):

* ``analytic_linear`` (1 unit): ``Linear(1, world_size, bias=False)`` of
  ``test_default_communication_hook_behavior`` (test_fsdp_comm_hooks.py);
* ``net_wrapped`` (3) / ``net_flat`` (1): ``Net(has_wrapping=True/False)``
  of test_fsdp_comm_hooks.py;
* ``nested_wrapped`` (4): ``NestedWrappedModule`` (common_fsdp.py) plus a root;
* ``always_wrap_nested`` (8): ``AlwaysWrapNestedWrappedModule`` (common_fsdp.py);
* ``transformer_shared`` (5; 6 with ``mixed_precision``):
  ``TransformerWithSharedParams`` (common_fsdp.py);
* ``gradient_probe`` (5): synthetic; its gradients are the input tensors.
* ``nonuniform_req_grad`` (4): ``NonUniformReqGradNWM`` (common_fsdp.py); only
  ``module.2.1`` trains; FSDP1 builds need ``use_orig_params=True``;
* ``mixture_of_experts`` (3): ``MixtureOfExperts`` (common_fsdp.py); the expert
  differs per rank and its unit is over a 1-rank group;
* ``unused_param`` (1): synthetic; a submodule forward never uses.
* ``late_branch`` (2): synthetic; a branch unit only the last micro-batch of a
  gradient-accumulation step uses.
* ``large_probe`` (2): synthetic; its gradients are its inputs, in buckets, flat parameters and
  reduce-scatter inputs of production size (25 MiB, more than 2^22 elements).
* ``switch_probe_64k``, ``_256k``, ``_1m``, ``_4m`` (2): synthetic; one parameter just past 2^16, 2^18, 2^20 or
  2^22 elements and a small one, trained for hundreds of steps on the long run's objective: a buffer past a
  hook's size switch for as long as its other switches need (``HookSpec.switches``, the nightly's combined cases).
"""

from __future__ import annotations

from typing import Dict, Type

from conformance.models.analytic import AnalyticLinear
from conformance.models.base import ReferenceModel
from conformance.models.large import LargeProbe
from conformance.models.late_branch import ACCUMULATION_MICRO_STEPS, LateBranchModel
from conformance.models.moe import MixtureOfExperts
from conformance.models.nested import AlwaysWrapNestedWrappedModule, NestedWrappedModule
from conformance.models.net import Net, NetFlat, NetWrapped
from conformance.models.nonuniform import NonUniformReqGradNWM
from conformance.models.probe import PROBE_ROOT_SHAPE, PROBE_SHAPES, GradientProbe
from conformance.models.switch import SWITCH_PROBES, SwitchProbe, switch_probe_for
from conformance.models.transformer import TransformerWithSharedParams
from conformance.models.unused import UnusedParamModel

__all__ = [
    "MODELS",
    "PROBE_ROOT_SHAPE",
    "PROBE_SHAPES",
    "AlwaysWrapNestedWrappedModule",
    "ACCUMULATION_MICRO_STEPS",
    "AnalyticLinear",
    "GradientProbe",
    "LargeProbe",
    "LateBranchModel",
    "MixtureOfExperts",
    "NestedWrappedModule",
    "Net",
    "NetFlat",
    "NetWrapped",
    "NonUniformReqGradNWM",
    "ReferenceModel",
    "SWITCH_PROBES",
    "SwitchProbe",
    "TransformerWithSharedParams",
    "UnusedParamModel",
    "get_model",
    "switch_probe_for",
]

#: Registry of reference models, keyed by ``ReferenceModel.name``.
MODELS: Dict[str, Type[ReferenceModel]] = {
    cls.name: cls
    for cls in (
        AnalyticLinear,
        NetWrapped,
        NetFlat,
        NestedWrappedModule,
        AlwaysWrapNestedWrappedModule,
        TransformerWithSharedParams,
        GradientProbe,
        NonUniformReqGradNWM,
        MixtureOfExperts,
        UnusedParamModel,
        LateBranchModel,
        LargeProbe,
        *SWITCH_PROBES.values(),
    )
}


def get_model(name: str) -> Type[ReferenceModel]:
    """The model class registered as ``name``; ``KeyError`` lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(
            f"unknown reference model {name!r}; known models: {', '.join(sorted(MODELS))}"
        ) from None
