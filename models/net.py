"""``Net``: the model of PyTorch's FSDP communication-hook tests."""

from __future__ import annotations

from typing import Callable, ClassVar, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["Net", "NetFlat", "NetWrapped"]


class Net(ReferenceModel):
    """``out(relu(net(x)))`` with ``net = Sequential(Linear(8, 16), ReLU, Linear(16, 8))``
    and ``out = Linear(8, 4)``.

    Mirrors ``Net`` in PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``
    (built there as ``FSDP(Net(has_wrapping, ...))``). Registered twice:
    :class:`NetWrapped` (``has_wrapping=True``) and :class:`NetFlat`
    (``has_wrapping=False``).

    * Parameters (float32): ``net.0.weight (16, 8)``, ``net.0.bias (16,)``,
      ``net.2.weight (8, 16)``, ``net.2.bias (8,)``, ``out.weight (4, 8)``,
      ``out.bias (4,)``.
    * FSDP units: ``has_wrapping=True``: 3: ``FSDP(net.2)`` inside
      ``FSDP(net)`` inside the root; ``has_wrapping=False``: 1 (the root).
    * Input: ``(x,)``, ``x`` of shape ``(16, 8)``, float32, uniform in [0, 1)
      (``torch.rand`` from the rank's generator). Output ``(16, 4)``; loss
      ``output.sum()``.

    Deviations from PyTorch: its tests draw the input after
    ``torch.manual_seed(0)``, the same on every rank; here it depends on the
    rank. PyTorch's nested units use the default process group; here every
    unit gets ``process_group=group``.
    """

    has_wrapping: ClassVar[bool]

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 4)

    @classmethod
    def _construct(cls, world_size: int) -> "Net":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        if self.has_wrapping:
            self.net[2] = wrap(self.net[2])
            self.net = wrap(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.net(x)))

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(16, 8, generator=rank_generator(rank)).to(device),)


class NetWrapped(Net):
    __doc__ = Net.__doc__
    name = "net_wrapped"
    has_wrapping = True
    fsdp_units = 3


class NetFlat(Net):
    __doc__ = Net.__doc__
    name = "net_flat"
    has_wrapping = False
    fsdp_units = 1
