"""``LargeProbe`` (``large_probe``): gradients of production size, chosen by the check, through every API's buffers.

Real hooks switch paths on size: they chunk buckets in 1-4 MiB pieces, send large buckets in low precision,
skip small tensors (PowerSGD's ``min_compression_rate``). DDP's first bucket is 1 MiB and the others 25 MiB
(``dist._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``); an FSDP unit of a real model holds 10^6 to 10^9
elements. A probe (its gradients are its inputs, bit for bit, as ``GradientProbe``'s) of that size lets one
case feed ordinary gradients through those buffers (parity) and place the named hard values where a
size-dependent path turns (the hard inputs), for the cost of two training steps. Every length is odd and not a
multiple of 3, so it is a multiple of no world size of 2 to 4 and of no power of two: a dropped tail, a
padding error or an off-by-one chunk boundary shows.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["LARGE_PROBE_SHAPES", "LargeProbe"]

#: The probe's parameters, in ``named_parameters()`` order: ``wide`` (6,620,005 elements, 25.25 MiB of float32),
#: ``head`` (615,755, 2.35 MiB), ``tail`` (370,513, 1.41 MiB): odd, not multiples of 3.
LARGE_PROBE_SHAPES: Tuple[Tuple[str, Tuple[int, ...]], ...] = (("wide", (6_620_005,)), ("head", (615_755,)),
                                                                ("tail", (370_513,)))


class _Leaf(nn.Module):
    """One parameter, zero (a probe's gradient is its input whatever its weight: drawing 25 MiB of normal values
    for every copy would only cost time); ``forward(g) = torch.dot(weight, g)``: the gradient ``g * 1.0`` is ``g``
    bit for bit, as with ``(weight * g).sum()``, without a product of 25 MiB in the forward."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return torch.dot(self.weight, g)


class LargeProbe(ReferenceModel):
    """``loss = sum(torch.dot(p, g) for p, g in zip(parameters, inputs))`` over parameters of production size, so
    that after ``loss.backward()`` each parameter's local gradient is exactly its input (as ``GradientProbe``).

    Not a PyTorch test model: sized so that each hook API hands its hook production-sized buffers, and so that
    ``wide``'s gradient starts each API's largest buffer, where the placed hard values must land
    (:func:`conformance.controller.hard_examples.placed_positions`).

    * Parameters (float32, zero), in ``named_parameters()`` order: ``wide.weight (6620005,)`` (25.25 MiB),
      ``head.weight (615755,)``, ``tail.weight (370513,)``; 7,606,273 in all (29 MiB).
    * DDP: the first iteration's one bucket holds them all in ``parameters()`` order, ``wide`` first; then,
      rebuilt in the order the gradients become ready (``wide`` first: the forward uses it last), a first
      bucket of ``wide`` alone (25.25 MiB: past both the 1 MiB first-bucket cap and the 25 MiB cap) and one of
      the rest (3.76 MiB). Either way ``wide`` starts the bucket.
    * FSDP units: 2: ``FSDP(wide)`` (a flat parameter of 6,620,005 elements before padding, more than 2^22) and
      the root (``head``, ``tail``). FSDP2 builds the same units, so its reduce-scatter input for ``wide`` exceeds
      2^22 elements, and a replica all-reduce hook on 2 shards gets 3,310,003 (more than 2^21).
    * Input: one tensor per parameter, of its shape, in ``named_parameters()`` order (``input_shapes()``);
      ``make_input`` gives uniform values in [-1, 1) from the rank's generator; the hard-input cases build their
      own on each rank from a description (:func:`conformance.shared.standalone_inputs.placed_tensor`).
      Output: a 0-d tensor, which ``loss`` returns as is.
    """

    name = "large_probe"
    fsdp_units = 2

    def __init__(self) -> None:
        super().__init__()
        for name, shape in LARGE_PROBE_SHAPES:
            self.add_module(name, _Leaf(shape[0]))

    @classmethod
    def input_shapes(cls) -> List[Tuple[int, ...]]:
        """Shapes of the inputs (= of the parameters, in ``named_parameters()`` order)."""
        return [shape for _, shape in LARGE_PROBE_SHAPES]

    @classmethod
    def _construct(cls, world_size: int) -> "LargeProbe":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        self.wide = wrap(self.wide)

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        if len(grads) != len(LARGE_PROBE_SHAPES):
            raise ValueError(f"LargeProbe takes {len(LARGE_PROBE_SHAPES)} tensors (shapes {self.input_shapes()}), "
                             f"got {len(grads)}")
        out = self.head(grads[1]) + self.tail(grads[2])
        return out + self.wide(grads[0])  # wide last: its gradient is ready first

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        gen = rank_generator(rank)
        return tuple((torch.rand(shape, generator=gen) * 2 - 1).to(device) for shape in cls.input_shapes())

    @classmethod
    def loss(cls, inputs: tuple, output: Any) -> torch.Tensor:
        return output if output.dim() == 0 else output.sum()
