"""Models whose buffers reach production sizes: ``WideLinear`` (``large_buffers``) and ``LargeProbe``
(``large_probe``).

Real hooks switch paths on size: they chunk buckets in 1-4 MiB pieces, send large buckets in low precision,
skip small tensors (PowerSGD's ``min_compression_rate``). DDP's first bucket is 1 MiB and the others 25 MiB
(``dist._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``); an FSDP unit of a real model holds 10^6 to 10^9
elements. Every length here is odd and not a multiple of 3, so it is a multiple of no world size of 2 to 4 and
of no power of two: a dropped tail, a padding error or an off-by-one chunk boundary shows. A wide linear layer
fed two rows keeps a step cheap on a CPU: the cost is the memory traffic of the buffers, not arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["LARGE_PROBE_NUMEL", "LargeProbe", "WideLinear"]

#: ``WideLinear``'s layers: ``(in_features, out_features, bias)``.
WIDE_LAYERS = ((240, 2555, True), (2555, 2591, False), (2591, 143, False))
#: Elements of ``LargeProbe``'s one parameter: 25 MiB of float32 and 12 bytes (a DDP bucket of at least
#: ``bucket_cap_mb=25``), odd and not a multiple of 3.
LARGE_PROBE_NUMEL = 6_553_603


class WideLinear(ReferenceModel):
    """``tail(wide(head(x)))``: ``head = Linear(240, 2555)``, ``wide = Linear(2555, 2591, bias=False)``, ``tail =
    Linear(2591, 143, bias=False)``; 7,606,273 parameters (29 MiB of float32).

    Not a PyTorch test model: sized so that each hook API hands its hook production-sized buffers.

    * Parameters (float32): ``head.weight (2555, 240)``, ``head.bias (2555,)`` (615,755 elements together,
      2.35 MiB), ``wide.weight (2591, 2555)`` (6,620,005, 25.25 MiB), ``tail.weight (143, 2591)`` (370,513,
      1.41 MiB): every count odd and not a multiple of 3.
    * DDP: one bucket of all (29 MiB) in the first iteration, then, rebuilt in the order the gradients become
      ready, a first bucket of 1.41 MiB (``tail``, past the 1 MiB first-bucket cap), one of 25.25 MiB
      (``wide``, past the 25 MiB cap) and one of 2.35 MiB (``head``).
    * FSDP units: 2: ``FSDP(wide)`` (a flat parameter of 6,620,005 elements before padding, more than 2^22)
      and the root (``head`` and ``tail``). FSDP2 builds the same units, so its reduce-scatter input for ``wide``
      exceeds 2^22 elements, and a replica all-reduce hook on 2 shards gets 1,296 x 2,555 = 3,311,280 (more
      than 2^21).
    * Input: ``(x,)``, ``x`` of shape ``(2, 240)``, float32, ``torch.rand`` from the rank's generator.
      Output ``(2, 143)``; loss ``output.sum()``.
    """

    name = "large_buffers"
    fsdp_units = 2
    max_steps = 2

    def __init__(self) -> None:
        super().__init__()
        (hi, ho, hb), (wi, wo, wb), (ti, to, tb) = WIDE_LAYERS
        self.head = nn.Linear(hi, ho, bias=hb)
        self.wide = nn.Linear(wi, wo, bias=wb)
        self.tail = nn.Linear(ti, to, bias=tb)

    @classmethod
    def _construct(cls, world_size: int) -> "WideLinear":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        self.wide = wrap(self.wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.wide(self.head(x)))

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(2, WIDE_LAYERS[0][0], generator=rank_generator(rank)).to(device),)


class LargeProbe(ReferenceModel):
    """``loss = (weight * g).sum()`` over one parameter of :data:`LARGE_PROBE_NUMEL` elements, so that after
    ``loss.backward()`` its local gradient is exactly ``g`` (as ``GradientProbe``): the hard inputs of a
    production-sized buffer.

    With one parameter, the hook's buffer starts where the parameter does under every API (DDP's one bucket,
    FSDP1's flat parameter, FSDP2's reduce-scatter input of a 1-D parameter, which shards it whole rows at a
    time), so a value placed at element ``k`` of the gradient reaches the hook at element ``k`` of its buffer:
    the named hard values are placed at its ends and at power-of-two boundaries
    (:func:`conformance.controller.hard_inputs.placed_positions`).

    * Parameters (float32, initialised ``randn``): ``weight (6553603,)``, 25 MiB and 12 bytes.
    * FSDP units: 1, the root.
    * Input: one tensor of the parameter's shape; ``make_input`` gives uniform values in [-1, 1) from the rank's
      generator; hard-input cases supply their own (``input_shapes()`` gives the list). Output: a 0-d tensor.
    """

    name = "large_probe"
    fsdp_units = 1

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(LARGE_PROBE_NUMEL))

    @classmethod
    def input_shapes(cls) -> List[Tuple[int, ...]]:
        """Shapes of the inputs (= of the parameters, in ``named_parameters()`` order)."""
        return [(LARGE_PROBE_NUMEL,)]

    @classmethod
    def _construct(cls, world_size: int) -> "LargeProbe":
        return cls()

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        gen = rank_generator(rank)
        return tuple((torch.rand(shape, generator=gen) * 2 - 1).to(device) for shape in cls.input_shapes())

    @classmethod
    def loss(cls, inputs: tuple, output: Any) -> torch.Tensor:
        return output if output.dim() == 0 else output.sum()
