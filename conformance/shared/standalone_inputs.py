"""A reproducer's inputs per step: the model's own (``MODEL.make_input``), a hard-input case's recorded values
(``CASE["inputs"]``), or the long run's regression onto random targets.

The writer (:mod:`conformance.reproducers.writer`) binds the file's ``step_inputs`` to the one its case
uses (:func:`model_inputs`, :func:`recorded_inputs`, :func:`regression_step_inputs`) and its ``loss``
to ``MODEL.loss`` or :func:`regression_loss`; these read the file's globals ``CASE`` and ``MODEL`` when
called. The rank side decodes large hard inputs (:func:`placed_tensor`) and trains the long run with
the same functions. Torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Type

import torch

from conformance.shared.standalone_main import Ranks

if TYPE_CHECKING:  # pragma: no cover - a reproducer defines it (the model's base class, written with the model)
    from conformance.models.base import ReferenceModel


def _float(text: str) -> float:
    return float.fromhex(text) if "0x" in text else float(text)


# -- the long run's objective ---------------------------------------------------------------------------------
# A model trained hundreds of steps on its own ``output.sum()`` loss overflows within ten: its gradients are then
# NaN on both sides, and NaN equals NaN, so nothing more is checked. The long run instead regresses onto random
# targets, with inputs that change every step: the gradients stay of order 0.1 for thousands of steps.


class SeededInputs(tuple):
    """One micro-batch's inputs (a tuple, passed as ``model(*inputs)``) and the seed of its regression target."""

    seed: int

    def __new__(cls, inputs: Tuple[torch.Tensor, ...], seed: int) -> "SeededInputs":
        out = super().__new__(cls, inputs)
        out.seed = seed
        return out


def regression_inputs(model: Type[ReferenceModel], rank: int, world_size: int, step: int, micro_steps: int,
                      device: torch.device) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step`` of a long run, one tuple per micro-batch: ``model.make_input`` with a seed
    of its own per rank, micro-batch and step (rank-dependent and distinct, as every check's inputs)."""
    out = []
    for k in range(micro_steps):
        index = rank + (k + step * micro_steps) * world_size
        out.append(SeededInputs(model.make_input(index, world_size, device), index))
    return out


def regression_loss(inputs: SeededInputs, output: torch.Tensor) -> torch.Tensor:
    """``mean((output - target) ** 2)``, the target uniform in [-1, 1) of ``output``'s shape from a CPU
    generator seeded by the micro-batch (:class:`SeededInputs`)."""
    gen = torch.Generator().manual_seed(1_000_003 + int(inputs.seed))
    target = (torch.rand(output.shape, generator=gen, dtype=torch.float32) * 2 - 1).to(output.device, output.dtype)
    return ((output - target) ** 2).mean()


#: Elements of the ordinary values a large hard input repeats (a prime: its period lines up with no power of two,
#: no shard and no chunk of a hook).
PLACED_PERIOD = 65_521


def placed_tensor(placed: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """A large hard input from its description (the suite's ``hard_examples.placed_examples``; a reproducer's
    ``CASE["inputs"]``): float32 ``shape``, filled with :data:`PLACED_PERIOD` uniform values in [-1, 1) from a CPU
    generator seeded ``seed``, repeated, times ``scale`` (float32); then ``values`` at the flat positions ``at``
    (floats or float hex). Repeating a block costs a copy, where drawing tens of millions of values costs
    tenths of a second a step."""
    numel = 1
    for d in placed["shape"]:
        numel *= int(d)
    gen = torch.Generator().manual_seed(int(placed["seed"]))
    block = (torch.rand(min(numel, PLACED_PERIOD), generator=gen) * 2 - 1) * torch.tensor(float(placed["scale"]),
                                                                                          dtype=torch.float32)
    out = block.repeat(-(-numel // block.numel()))[:numel]  # a fresh tensor's view: written in place below
    if placed["at"]:
        out[torch.tensor(placed["at"], dtype=torch.int64)] = torch.tensor(
            [_float(v) if isinstance(v, str) else float(v) for v in placed["values"]], dtype=torch.float32)
    return out.reshape(tuple(placed["shape"])).to(device)


def model_inputs(ranks: Ranks, step: int) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step``, one tuple per micro-batch: ``MODEL.make_input(rank + k * world_size, ...)``
    (the same every step)."""
    return [MODEL.make_input(ranks.rank + k * ranks.world_size, ranks.world_size, ranks.device)
            for k in range(CASE["micro_steps"])]


def recorded_inputs(ranks: Ranks, step: int) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step`` of a hard-input case: the recorded gradients ``CASE["inputs"][step][rank]``
    (float32 hex, or a large input's description: :func:`placed_tensor`), one micro-batch."""
    values = CASE["inputs"][step][ranks.rank]
    return [tuple(placed_tensor(vs, ranks.device) if isinstance(vs, dict) else
                  torch.tensor([_float(v) for v in vs], dtype=torch.float32).reshape(shape).to(ranks.device)
                  for vs, shape in zip(values, MODEL.input_shapes()))]


def regression_step_inputs(ranks: Ranks, step: int) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step`` of a long run (:func:`regression_inputs`)."""
    return regression_inputs(MODEL, ranks.rank, ranks.world_size, step, CASE["micro_steps"], ranks.device)


def step_inputs_of(case: Dict[str, Any]) -> str:
    """The name of the function that gives ``case``'s inputs (the reproducer binds ``STEP_INPUTS`` to it)."""
    if case.get("objective") == "regression":
        return regression_step_inputs.__name__
    return model_inputs.__name__ if case.get("inputs") is None else recorded_inputs.__name__


def loss_of(case: Dict[str, Any]) -> str:
    """The expression of ``case``'s loss (the reproducer binds ``LOSS`` to it)."""
    return regression_loss.__name__ if case.get("objective") == "regression" else "MODEL.loss"
