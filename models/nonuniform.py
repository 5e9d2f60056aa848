"""``NonUniformReqGradNWM`` from PyTorch's ``torch/testing/_internal/common_fsdp.py``:
a nested model in which only the parameters of its last layer train."""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["NonUniformReqGradNWM", "REQ_GRAD_PATTERN", "is_trainable_name"]

#: PyTorch's ``req_grad_pattern``: the parameters that stay trainable are those
#: of ``module.2.1``. ``re.match`` against a parameter name relative to the
#: model, with or without an interstitial ``_fsdp_wrapped_module.``
#: (``module.2.1.weight`` and ``module.2._fsdp_wrapped_module.1.weight`` both
#: match; ``module.2.0.weight`` and ``module.1.1.weight`` do not).
REQ_GRAD_PATTERN = re.compile(r"module\.2.*\.1.*")

_FSDP_PREFIX = "_fsdp_wrapped_module."


def is_trainable_name(name: str) -> bool:
    """Whether the parameter called ``name`` stays trainable.

    ``name`` may come from the model itself, from a nested-wrapped model or
    from the root FSDP instance (whose names start with
    ``_fsdp_wrapped_module.``): the pattern is tried on the name as given and
    with every ``_fsdp_wrapped_module.`` removed."""
    return bool(
        REQ_GRAD_PATTERN.match(name) or REQ_GRAD_PATTERN.match(name.replace(_FSDP_PREFIX, ""))
    )


class NonUniformReqGradNWM(ReferenceModel):
    """``module = Sequential(Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)),
    Sequential(Linear(16, 4), Linear(4, 8)))`` (no activations), applied to
    ``x``; every parameter is frozen (``requires_grad=False``) except the two
    of ``module.2.1``.

    Mirrors ``NonUniformReqGradNWM`` of ``torch/testing/_internal/common_fsdp.py``
    (``FSDPInitMode.RECURSIVE``; used by PyTorch's ``ShardedGradScaler`` tests),
    plus a root FSDP unit on top. It differs from ``NestedWrappedModule`` in
    that the last two ``Linear`` layers sit together in one ``nn.Sequential``
    FSDP unit: with ``FULL_SHARD``/``SHARD_GRAD_OP`` over 2 ranks that unit's
    flat parameter (108 elements: ``module.2.0`` 68, then ``module.2.1`` 40)
    splits as ``[0, 54)`` / ``[54, 108)``, so rank 0 holds no element of any
    trainable parameter (no non-zero local shard of a parameter that gets a
    gradient).

    * Parameters (float32): ``module.0.{weight (4, 8), bias (4,)}``,
      ``module.1.0.{weight (16, 4), bias (16,)}``,
      ``module.1.1.{weight (16, 16), bias (16,)}``,
      ``module.2.0.{weight (4, 16), bias (4,)}``,
      ``module.2.1.{weight (8, 4), bias (8,)}``. Trainable: only
      ``module.2.1.weight`` and ``module.2.1.bias`` (:func:`is_trainable_name`).
    * FSDP units: 4: ``FSDP(module.1.0)`` inside ``FSDP(module.1)``,
      ``FSDP(module.2)``, and the root (holding the frozen ``module.0``).
    * Input: ``(x,)``, ``x`` of shape ``(4, 8)``, float32, ``torch.rand`` from
      the rank's generator. Output ``(4, 8)``; loss ``output.sum()``.

    Freezing follows PyTorch: the plain build is frozen after construction;
    the FSDP build is frozen after the nested units are wrapped (so their flat
    parameters were created from trainable parameters, as in PyTorch) and
    before the root is wrapped, and the pattern is applied once more to the
    root's parameters (a no-op that keeps the frozen set right whatever the
    wrapping).

    ``build`` with ``fsdp_kwargs`` (FSDP1) requires
    ``fsdp_kwargs["use_orig_params"] is True`` and raises ``ValueError``
    otherwise: with ``use_orig_params=False`` the nested units expose only
    flat parameters, whose names never match the pattern, so PyTorch's
    freezing would leave nothing trainable (and FSDP1 rejects flat parameters
    that mix frozen and trainable originals when frozen before wrapping).

    Deviation from PyTorch: its nested units use the group and kwargs given to
    ``init``, and its root is added by the test harness; here every unit
    (root included) gets ``process_group=group`` and ``device_id=device``.
    """

    name = "nonuniform_req_grad"
    fsdp_units = 4

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 8)),
        )

    @classmethod
    def _construct(cls, world_size: int) -> "NonUniformReqGradNWM":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        inner = self.module[1]
        inner[0] = wrap(inner[0])
        self.module[1] = wrap(inner)
        self.module[2] = wrap(self.module[2])
        # PyTorch freezes after the nested wrapping, before the root exists.
        self.set_nonuniform_req_grad(self)

    @staticmethod
    def set_nonuniform_req_grad(model: nn.Module) -> None:
        """Freeze every parameter of ``model`` whose name is not trainable
        (:func:`is_trainable_name`). Idempotent; never unfreezes."""
        for pname, p in model.named_parameters():
            if not is_trainable_name(pname):
                p.requires_grad_(False)

    @classmethod
    def plain(cls, *, group: Any, device: torch.device) -> nn.Module:
        """As :meth:`ReferenceModel.plain`, then freeze all but ``module.2.1``."""
        model = super().plain(group=group, device=device)
        cls.set_nonuniform_req_grad(model)
        return model

    @classmethod
    def build(
        cls,
        *,
        group: Any,
        device: torch.device,
        fsdp_kwargs: Optional[Dict[str, Any]],
    ) -> nn.Module:
        """As :meth:`ReferenceModel.build` (which freezes all but ``module.2.1``: :meth:`build_fsdp`).

        Raises ``ValueError`` when ``fsdp_kwargs`` is a dict without
        ``use_orig_params=True``."""
        if fsdp_kwargs is not None and fsdp_kwargs.get("use_orig_params") is not True:
            raise ValueError(
                f"{cls.__name__} (model {cls.name!r}) freezes all parameters but "
                "module.2.1, which FSDP1 supports only with use_orig_params=True; "
                f"pass fsdp_kwargs with use_orig_params=True (got "
                f"use_orig_params={fsdp_kwargs.get('use_orig_params', '<unset>')!r})"
            )
        return super().build(group=group, device=device, fsdp_kwargs=fsdp_kwargs)

    @classmethod
    def build_fsdp(cls, *, group: Any, device: torch.device, fsdp_kwargs: Dict[str, Any]) -> nn.Module:
        """As :meth:`ReferenceModel.build_fsdp`, then freeze all but ``module.2.1``."""
        model = super().build_fsdp(group=group, device=device, fsdp_kwargs=fsdp_kwargs)
        cls.set_nonuniform_req_grad(model)
        return model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(4, 8, generator=rank_generator(rank)).to(device),)
