"""``AnalyticLinear``: a model whose averaged gradient is known in closed form."""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, world_size_of

__all__ = ["AnalyticLinear"]


class AnalyticLinear(ReferenceModel):
    """``nn.Linear(1, world_size, bias=False)`` fed the rank as its only input.

    Mirrors the model of ``TestCommunicationHooks.test_default_communication_hook_behavior``
    in PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``.

    * Parameters: ``linear.weight`` of shape ``(world_size, 1)``, float32.
    * FSDP units: 1 (the root; no nested units).
    * Input: ``(torch.tensor([float(rank)]),)``, shape ``[1]``, float32.
    * Output: shape ``[world_size]``; loss ``output.sum()``.

    On rank ``r`` every element of the local gradient is exactly ``r``, so after
    averaging over the group every gradient element equals
    ``sum(range(world_size)) / world_size`` (exactly representable for any
    realistic world size).
    """

    name = "analytic_linear"
    fsdp_units = 1

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(1, world_size, bias=False)

    @classmethod
    def _world_size(cls, group: Any) -> int:
        return world_size_of(group)

    @classmethod
    def _construct(cls, world_size: int) -> "AnalyticLinear":
        return cls(world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.tensor([float(rank)]).to(device),)

    @staticmethod
    def expected_grad(world_size: int) -> float:
        """The value of every element of the group-averaged gradient."""
        return sum(range(world_size)) / world_size
