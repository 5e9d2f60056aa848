"""``NestedWrappedModule`` and ``AlwaysWrapNestedWrappedModule`` from PyTorch's
``torch/testing/_internal/common_fsdp.py``."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["AlwaysWrapNestedWrappedModule", "NestedWrappedModule"]


class NestedWrappedModule(ReferenceModel):
    """``module = Sequential(Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)),
    Linear(16, 4), Linear(4, 8))`` (no activations), applied to ``x``.

    Mirrors ``NestedWrappedModule`` of ``torch/testing/_internal/common_fsdp.py``
    with ``FSDPInitMode.RECURSIVE``, plus a root FSDP unit on top (PyTorch's
    ``init`` leaves the top level unwrapped; a root is needed to call
    ``register_comm_hook``).

    * Parameters (float32): ``module.0.{weight (4, 8), bias (4,)}``,
      ``module.1.0.{weight (16, 4), bias (16,)}``,
      ``module.1.1.{weight (16, 16), bias (16,)}``,
      ``module.2.{weight (4, 16), bias (4,)}``, ``module.3.{weight (8, 4), bias (8,)}``.
    * FSDP units: 4: ``FSDP(module.1.0)`` inside ``FSDP(module.1)``,
      ``FSDP(module.2)``, and the root (holding ``module.0``, ``module.3``).
    * Input: ``(x,)``, ``x`` of shape ``(4, 8)``, float32, ``torch.rand`` from
      the rank's generator. Output ``(4, 8)``; loss ``output.sum()``.
    """

    name = "nested_wrapped"
    fsdp_units = 4

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
                                    nn.Linear(16, 4), nn.Linear(4, 8))

    @classmethod
    def _construct(cls, world_size: int) -> "NestedWrappedModule":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        inner = self.module[1]
        inner[0] = wrap(inner[0])
        self.module[1] = wrap(inner)
        self.module[2] = wrap(self.module[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(4, 8, generator=rank_generator(rank)).to(device),)


class AlwaysWrapNestedWrappedModule(NestedWrappedModule):
    """The :class:`NestedWrappedModule` network, unwrapped, under one root
    ``FSDP(model, auto_wrap_policy=always_wrap_policy)``.

    Mirrors ``AlwaysWrapNestedWrappedModule`` of
    ``torch/testing/_internal/common_fsdp.py`` (``FSDPInitMode.RECURSIVE``).

    * Parameters and input: as :class:`NestedWrappedModule`.
    * FSDP units: 8: the policy wraps every module that holds parameters:
      the root, ``module``, ``module.0``, ``module.1``, ``module.1.0``,
      ``module.1.1``, ``module.2``, ``module.3`` (the three containers end up
      with no parameters of their own).
    """

    name = "always_wrap_nested"
    fsdp_units = 8

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        pass  # the auto wrap policy of the root call does all the wrapping

    @classmethod
    def _root_fsdp_kwargs(cls, fsdp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        from torch.distributed.fsdp.wrap import always_wrap_policy

        return {"auto_wrap_policy": fsdp_kwargs.pop("auto_wrap_policy", always_wrap_policy)}
