"""What the model tests expect of the reference models in ``models/`` (``tests/test_models.py``,
``tests/test_models_fsdp.py``): the FSDP units each model's build wraps, and which parameters get no gradient
by design."""

from __future__ import annotations

import torch.nn as nn

from conformance.models import MODELS

#: The reference models' names, sorted: what the per-model tests are parametrized over.
ALL = sorted(MODELS)

#: What each model's FSDP build must wrap: module paths (FSDP wrapper prefixes
#: removed, "" = root) of the FSDP units, as PyTorch's test models wrap them.
EXPECTED_UNITS = {
    "analytic_linear": {""},
    "net_wrapped": {"", "net", "net.2"},
    "net_flat": {""},
    "nested_wrapped": {"", "module.1", "module.1.0", "module.2"},
    "always_wrap_nested": {
        "",
        "module",
        "module.0",
        "module.1",
        "module.1.0",
        "module.1.1",
        "module.2",
        "module.3",
    },
    "transformer_shared": {
        "",
        "transformer.encoder.layers.0",
        "transformer.encoder.layers.1",
        "transformer.decoder.layers.0",
        "transformer.decoder.layers.1",
    },
    "gradient_probe": {"", "leaves.0", "leaves.1", "leaves.2", "leaves.3"},
    "nonuniform_req_grad": {"", "module.1", "module.1.0", "module.2"},
    "mixture_of_experts": {"", "module.1", "module.2"},
    "unused_param": {""},
    "late_branch": {"", "branch"},
    "large_probe": {"", "wide"},
    **{name: {"", "wide"} for name in ("switch_probe_64k", "switch_probe_256k", "switch_probe_1m", "switch_probe_4m")},
}


def gradless(cls, pname: str, p: nn.Parameter) -> bool:
    """Parameters that get no gradient by design: frozen ones
    (``nonuniform_req_grad``) and the ones forward never uses (``unused_param``)."""
    return not p.requires_grad or pname in getattr(cls, "unused_parameter_names", ())
