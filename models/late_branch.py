"""``LateBranchModel``: a branch, its own FSDP unit, that only the last micro-batch of a step uses."""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["ACCUMULATION_MICRO_STEPS", "LateBranchModel"]

#: Micro-batches per step of the gradient-accumulation cases; the branch runs on the last one only.
ACCUMULATION_MICRO_STEPS = 3


class LateBranchModel(ReferenceModel):
    """``head(h + branch(h) if use_branch else h)``, ``h = relu(trunk(x))``, with ``trunk = Linear(8, 16)``,
    ``branch = Linear(16, 16)`` (its own FSDP unit) and ``head = Linear(16, 4)``.

    Synthetic, for gradient accumulation: micro-batch ``k`` of a step gets
    ``make_input(rank + k * world_size, ...)`` (:class:`conformance.ranks.checks.models.ApiModels`), and
    only micro-batch ``ACCUMULATION_MICRO_STEPS - 1``, the synchronising one, sets ``use_branch``. So the
    branch's parameters get their first gradient of a step on the backward that reduces, where FSDP has
    accumulated nothing for them (the path of PyTorch issue 196996). Every rank takes the branch on the
    same micro-batch, so the collectives match.

    * Parameters (float32): ``trunk.{weight (16, 8), bias (16,)}``, ``branch.{weight (16, 16), bias
      (16,)}``, ``head.{weight (4, 16), bias (4,)}``.
    * FSDP units: 2 (``branch``, the root).
    * Input: ``(x, use_branch)``: ``x`` of shape ``(4, 8)``, float32, ``torch.rand`` from the seed's
      generator; ``use_branch`` a 0-d bool tensor. Output ``(4, 4)``; loss ``output.sum()``.
    """

    name = "late_branch"
    fsdp_units = 2
    #: The parameters ``forward`` leaves unused on every micro-batch but the last (a step of one
    #: micro-batch never uses them).
    unused_parameter_names = ("branch.weight", "branch.bias")

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch: nn.Module = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    @classmethod
    def _construct(cls, world_size: int) -> "LateBranchModel":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        self.branch = wrap(self.branch)

    def forward(self, x: torch.Tensor, use_branch: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        if bool(use_branch):
            h = h + self.branch(h)
        return self.head(h)

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[Any, ...]:
        micro_batch = rank // max(world_size, 1)
        x = torch.rand(4, 8, generator=rank_generator(rank)).to(device)
        return x, torch.tensor(micro_batch == ACCUMULATION_MICRO_STEPS - 1, device=device)
