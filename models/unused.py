"""``UnusedParamModel``: a small network with a submodule its forward never uses."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["UnusedParamModel"]


class UnusedParamModel(ReferenceModel):
    """``fc2(relu(fc1(x)))`` with ``fc1 = Linear(8, 16)``, ``fc2 = Linear(16, 4)``,
    plus ``unused = Linear(16, 16)``, registered between them, that ``forward``
    never calls.

    Synthetic (no PyTorch test model mirrored): for DDP's
    ``find_unused_parameters=True`` path. ``unused`` sits between the used
    layers in registration order, so DDP's reverse-order buckets hold it
    between used parameters.

    * Parameters (float32), in registration order: ``fc1.weight (16, 8)``,
      ``fc1.bias (16,)``, ``unused.weight (16, 16)``, ``unused.bias (16,)``,
      ``fc2.weight (4, 16)``, ``fc2.bias (4,)``. After ``backward`` the plain
      model's ``unused.*`` have ``grad is None``; every other parameter gets a
      gradient.
    * FSDP units: 1 (the root). Under FSDP1 the unused parameters share the
      root's flat parameter, whose gradient is zero in their span; with
      ``use_orig_params=True`` (torch 2.13, any sharding strategy) their
      ``.grad`` is then an all-zero tensor (where the rank holds part of them),
      not ``None``.
    * Input: ``(x,)``, ``x`` of shape ``(4, 8)``, float32, ``torch.rand`` from
      the rank's generator. Output ``(4, 4)``; loss ``output.sum()``.
    """

    name = "unused_param"
    fsdp_units = 1
    #: Names of the parameters ``forward`` never uses.
    unused_parameter_names = ("unused.weight", "unused.bias")

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.unused = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    @classmethod
    def _construct(cls, world_size: int) -> "UnusedParamModel":
        return cls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(4, 8, generator=rank_generator(rank)).to(device),)
