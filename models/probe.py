"""``GradientProbe``: a model whose gradients are caller-supplied tensors."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["GradientProbe", "PROBE_SHAPES", "PROBE_ROOT_SHAPE"]

#: Shapes of the parameters that each get their own nested FSDP unit: a unit
#: smaller than any world size > 1, numels (1, 5, 21, 64) that need padding
#: for most world sizes, a 2-D parameter, and one that divides evenly by 2, 4, 8.
PROBE_SHAPES: Tuple[Tuple[int, ...], ...] = ((1,), (5,), (7, 3), (64,))
#: Shape of the parameter held directly by the root FSDP unit.
PROBE_ROOT_SHAPE: Tuple[int, ...] = (3,)


class _Leaf(nn.Module):
    """One parameter; ``forward(g) = (weight * g).sum()``."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


class GradientProbe(ReferenceModel):
    """``loss = sum((p * g).sum() for p, g in zip(parameters, inputs))``, so that
    after ``loss.backward()`` each parameter's local gradient is exactly ``g``
    (``1.0 * g`` bit for bit: NaN, +-Inf, -0.0, subnormals and values near the
    fp16/bf16 limits pass through unchanged).

    Not a PyTorch test model: a synthetic model for hard-input checks on a
    hook's reduction, with FSDP units shaped like the edge cases of
    ``FullyShardedDataParallel``'s flat-parameter sharding (units with fewer
    elements than ranks, numels that need padding).

    * Parameters (float32, initialised ``randn``), in ``named_parameters()``
      order of the unwrapped model: ``weight (3,)`` on the root, then
      ``leaves.0.weight (1,)``, ``leaves.1.weight (5,)``,
      ``leaves.2.weight (7, 3)``, ``leaves.3.weight (64,)``
      (``input_shapes()`` gives this list).
    * FSDP units: 5: each leaf module wrapped as its own unit, plus the root
      unit holding ``weight``.
    * Input: one tensor per parameter, same shapes, in the order of
      ``input_shapes()``. ``make_input`` gives float32 uniform values in
      [-1, 1) from the rank's generator; callers supply their own values (any
      floating dtype) for hard inputs. Output: a 0-d tensor, which ``loss``
      returns as is.
    """

    name = "gradient_probe"
    fsdp_units = 1 + len(PROBE_SHAPES)

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*PROBE_ROOT_SHAPE))
        self.leaves = nn.ModuleList(_Leaf(shape) for shape in PROBE_SHAPES)

    @classmethod
    def input_shapes(cls) -> List[Tuple[int, ...]]:
        """Shapes of the inputs (= of the parameters, in ``named_parameters()`` order)."""
        return [tuple(PROBE_ROOT_SHAPE)] + [tuple(s) for s in PROBE_SHAPES]

    @classmethod
    def _construct(cls, world_size: int) -> "GradientProbe":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        for i in range(len(self.leaves)):
            self.leaves[i] = wrap(self.leaves[i])

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        if len(grads) != 1 + len(self.leaves):
            raise ValueError(
                f"GradientProbe takes {1 + len(self.leaves)} tensors "
                f"(shapes {self.input_shapes()}), got {len(grads)}"
            )
        out = (self.weight * grads[0]).sum()
        for leaf, g in zip(self.leaves, grads[1:]):
            # Call the (possibly FSDP-wrapped) leaf so that its unit unshards.
            out = out + leaf(g)
        return out

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        gen = rank_generator(rank)
        return tuple(
            (torch.rand(shape, generator=gen) * 2 - 1).to(device)
            for shape in cls.input_shapes()
        )

    @classmethod
    def loss(cls, inputs: tuple, output: Any) -> torch.Tensor:
        return output if output.dim() == 0 else output.sum()
