"""Hard gradient inputs: the named examples, the hypothesis strategy, and the patterns placed in a production-sized
buffer; what a hard-input case (:mod:`conformance.controller.hard_inputs`) sends the ranks.

Gradients are drawn per rank (so ranks differ) from a mix that stresses a
reduction: values near the reduce dtype's overflow threshold (where FSDP's
pre-divide decides between a finite sum and ``inf``), zeros of both signs,
subnormals of the reduce dtype, NaN, +/-Inf, and ordinary values. Each rank's
ordinary values have their own magnitude (:data:`RANK_MAGNITUDES`): in real
data-parallel batches one rank's gradients can be 10**6 times another's, and a
hook that decides anything from its own rank's values alone (a scale, a
rescue from underflow) decides differently there. They are float32 tensors
(the parameters' dtype); the native path casts them to the reduce dtype itself.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hypothesis import strategies as st


Shapes = Sequence[Tuple[int, ...]]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: float32 subnormals (the parameter dtype's): the smallest one and one near the normal range.
FLOAT32_SUBNORMALS = [float(torch.tensor(2.0 ** -149)), float(torch.tensor(-(2.0 ** -130)))]


def special_values(reduce_dtype: Optional[torch.dtype]) -> Dict[str, List[float]]:
    """Named groups of hard values for a claim's reduce dtype (``None``: float32).

    All values are representable in float32, the parameter dtype.
    """
    dtype = reduce_dtype or torch.float32
    info = torch.finfo(dtype)
    big = float(info.max)
    near_max = [0.75 * big, -0.75 * big, 0.55 * big, big, -big]
    subnormal = float(info.smallest_normal) / 2 ** (info.bits // 4)
    return {
        "near_overflow": [float(torch.tensor(v, dtype=torch.float32)) for v in near_max],
        "zero": [0.0, -0.0],
        "subnormal": [float(info.smallest_normal), subnormal, -subnormal] + FLOAT32_SUBNORMALS,
        "nonfinite": [float("nan"), float("inf"), float("-inf")],
    }


def _tensor(values: Sequence[float], shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32).reshape(shape)


class Drawn:
    """One generated example: ``grads[rank][i]`` (float32 tensors) for the probe's parameters.

    Its ``repr`` (what hypothesis prints as the falsifying example) lists only
    the elements that are not ``0.0``, by rank, parameter FQN and index, so a
    shrunk example reads as "rank 0: leaves.1.weight[3] = inf".
    """

    def __init__(self, values: Sequence[Sequence[Sequence[float]]], shapes: Shapes, names: Sequence[str]):
        self.values = values
        self.shapes = list(shapes)
        self.names = list(names)

    def grads(self) -> List[List[torch.Tensor]]:
        return [[_tensor(v, s) for v, s in zip(rank, self.shapes)] for rank in self.values]

    def __repr__(self) -> str:
        parts = []
        for r, rank in enumerate(self.values):
            for name, vs in zip(self.names, rank):
                parts += [f"rank {r}: {name}[{k}] = {v!r}" for k, v in enumerate(vs)
                          if not (v == 0.0 and math.copysign(1.0, v) > 0)]
        shown = "; ".join(parts[:12]) + (f"; ... ({len(parts)} in all)" if len(parts) > 12 else "")
        return f"<every element 0.0 except: {shown or 'none'}>"


#: The magnitudes of the ranks' ordinary values, rank ``r`` taking ``RANK_MAGNITUDES[r % 4]``: six orders of
#: magnitude apart at 2 ranks, nine at 4. Every ordinary value times any of them stays a normal number in
#: float16 and bfloat16 but for rank 1's, which fall below float16's normal range (as small gradients do).
RANK_MAGNITUDES = (1.0, 1e-6, 1e3, 1e-3)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (the dtype the gradients are built in)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def hard_gradients(world_size: int, shapes: Shapes, names: Sequence[str],
                   reduce_dtype: Optional[torch.dtype]) -> st.SearchStrategy:
    """Per-rank probe gradients, drawn element by element (a :class:`Drawn`).

    Each element is ``0.0`` (what shrinking moves towards), one of the hard
    values of :func:`special_values` for the claim's reduce dtype, or an
    ordinary float32 in [-4, 4] times its rank's magnitude (one of
    :data:`RANK_MAGNITUDES`, drawn per rank, shrinking towards 1); so a failure
    shrinks to the few elements, on the few ranks, that still make the hook
    differ from the reference.
    """
    specials = [v for vs in special_values(reduce_dtype).values() for v in vs]

    def one_rank(magnitude: float) -> st.SearchStrategy:
        ordinary = st.floats(-4.0, 4.0, width=32, allow_subnormal=False)
        if magnitude != 1.0:
            ordinary = ordinary.map(lambda v: _float32(v * magnitude))
        element = st.one_of(st.just(0.0), st.sampled_from(specials), ordinary)
        return st.tuples(*[st.lists(element, min_size=_numel(s), max_size=_numel(s)) for s in shapes])

    rank = st.sampled_from(RANK_MAGNITUDES).flatmap(one_rank)
    return st.lists(rank, min_size=world_size, max_size=world_size).map(
        lambda values: Drawn(values, shapes, names))


def explicit_examples(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> Dict[str, list]:
    """Deterministic hard inputs every hard-input case runs first, by name.

    * ``near_overflow``: every rank at 0.75x the reduce dtype's max; the sum of
      two such values overflows unless the hook pre-divides as FSDP does.
    * ``zeros``: +0 on rank 0, -0 elsewhere.
    * ``nan_one_rank``: NaN on rank 0 only, ordinary values elsewhere.
    * ``opposite_infinities``: +Inf on rank 0 and -Inf on rank 1 (NaN after the sum).
    * ``subnormals``: the reduce dtype's subnormals and smallest normal.
    * ``float32_subnormals``: subnormals of float32, the parameter dtype.
    """
    groups = special_values(reduce_dtype)
    big = groups["near_overflow"][0]
    tiny = groups["subnormal"]

    def fill(fn) -> list:
        return [[_tensor([fn(r, i, k) for k in range(_numel(s))], s) for i, s in enumerate(shapes)]
                for r in range(world_size)]

    return {name: fill(fn) for name, fn in _patterns(big, tiny).items()}


def _patterns(big: float, tiny: Sequence[float]) -> Dict[str, Callable[[int, int, int], float]]:
    """``pattern(rank, parameter index, element index) -> value`` of each named example."""
    def ordinary(r: int, i: int, k: int) -> float:
        return float((r + 1) * 0.25 + (i + k) * 0.125)

    return {
        "near_overflow": lambda r, i, k: big if (k + r) % 3 else -big,
        "zeros": lambda r, i, k: 0.0 if r == 0 else -0.0,
        "nan_one_rank": lambda r, i, k: float("nan") if r == 0 and k % 2 == 0 else ordinary(r, i, k),
        "opposite_infinities": lambda r, i, k: ((float("inf") if r == 0 else float("-inf") if r == 1
                                                 else ordinary(r, i, k)) if k % 2 == 0 else ordinary(r, i, k)),
        "subnormals": lambda r, i, k: tiny[(r + k) % len(tiny)],
        "float32_subnormals": lambda r, i, k: FLOAT32_SUBNORMALS[(r + k) % 2] * (k % 5 + 1),
    }


#: The most probe elements whose hard inputs are drawn and sent element by element; a probe of production size
#: (``large_probe``, 25 MiB) gets its named patterns placed instead (:func:`placed_examples`).
MAX_DRAWN_ELEMENTS = 4096


#: The label of the packed named example (:func:`named_hard_values`) in failure messages.
NAMED_LABEL = "named hard values"


def named_hard_values(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> list:
    """Every pattern of :func:`explicit_examples` packed into one example, so it costs one step.

    Element ``k`` of parameter ``i`` holds pattern ``(k + i) mod 6`` (in the
    order of :func:`explicit_examples`), at that pattern's own element
    ``k // 6``; so every pattern reaches the large parameters and the small FSDP
    units get different ones. A reduction is elementwise, so packing changes
    nothing for a hook that reduces correctly, and a hook that looks at a whole
    bucket (a NaN check) still sees every pattern. ``grads[rank][i]`` as there.
    """
    groups = special_values(reduce_dtype)
    fns = list(_patterns(groups["near_overflow"][0], groups["subnormal"]).values())
    return [[_tensor([fns[(k + i) % len(fns)](r, i, k // len(fns)) for k in range(_numel(s))], s)
             for i, s in enumerate(shapes)] for r in range(world_size)]


#: The label of the per-rank magnitudes example (:func:`rank_magnitude_values`) in failure messages.
RANK_MAGNITUDES_LABEL = "per-rank magnitudes"


def rank_magnitude_values(world_size: int, shapes: Shapes) -> list:
    """Ordinary values, every rank at its own magnitude (rank ``r`` times ``RANK_MAGNITUDES[r % 4]``), unpacked.

    Not packed into :func:`named_hard_values`: there every bucket of every rank
    holds values near the reduce dtype's overflow, so no rank's values are
    small as a whole. Here rank 1's gradients are 10**6 times smaller than
    rank 0's everywhere. ``grads[rank][i]`` as there.
    """
    def value(r: int, i: int, k: int) -> float:
        ordinary = (r + 1) * 0.25 + (i + k) * 0.125 + (k % 7) / 64.0
        return _float32(ordinary * (1 - 2 * (k % 2)) * RANK_MAGNITUDES[r % len(RANK_MAGNITUDES)])

    return [[_tensor([value(r, i, k) for k in range(_numel(s))], s) for i, s in enumerate(shapes)]
            for r in range(world_size)]


# -- production-sized buffers: the patterns placed where a size-dependent path goes wrong ----------------------


def placed_positions(numel: int, world_size: int) -> List[int]:
    """Where the named patterns go in a buffer of ``numel`` elements split over ``world_size`` ranks: both ends,
    every power-of-two boundary ``2^k - 1, 2^k, 2^k + 1`` (``k >= 4``: where a loop over chunks of 2^k elements
    turns), and both sides of each shard boundary (a multiple of ``ceil(numel / world_size)``); sorted, each once.
    A chunk loop that drops its tail, a padding error or an off-by-one chunk boundary misses one of them."""
    at = {0, 1, 2, numel - 3, numel - 2, numel - 1}
    k = 4
    while 2 ** k + 1 < numel:
        at.update((2 ** k - 1, 2 ** k, 2 ** k + 1))
        k += 1
    shard = -(-numel // world_size)
    for r in range(1, world_size):
        at.update((r * shard - 1, r * shard))
    return sorted(i for i in at if 0 <= i < numel)


def placed_examples(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> List[Tuple[str, Any]]:
    """The named examples of a probe of production size (``large_probe``), as descriptions each rank builds
    (:func:`~conformance.shared.standalone_inputs.placed_tensor`): ordinary values everywhere (uniform in
    [-1, 1), seeded by rank and parameter), then

    * every pattern of :func:`named_hard_values` placed at :func:`placed_positions` (position ``j`` holds
      pattern ``j mod 6`` at that pattern's element ``j // 6``, as packed there);
    * the ranks at their own magnitudes (:data:`RANK_MAGNITUDES`), nothing placed.
    """
    groups = special_values(reduce_dtype)
    fns = list(_patterns(groups["near_overflow"][0], groups["subnormal"]).values())

    def placed(r: int, i: int, shape: Tuple[int, ...], scale: float, at: Sequence[int]) -> Dict[str, Any]:
        return {"shape": tuple(shape), "seed": 7919 * (r + 1) + i, "scale": scale, "at": list(at),
                "values": [fns[j % len(fns)](r, i, j // len(fns)) for j in range(len(at))]}

    named = [[placed(r, i, s, 1.0, placed_positions(_numel(s), world_size)) for i, s in enumerate(shapes)]
             for r in range(world_size)]
    magnitudes = [[placed(r, i, s, RANK_MAGNITUDES[r % len(RANK_MAGNITUDES)], ()) for i, s in enumerate(shapes)]
                  for r in range(world_size)]
    return [(PLACED_LABEL, named), (RANK_MAGNITUDES_LABEL, magnitudes)]


#: The label of the placed named example (:func:`placed_examples`) in failure messages.
PLACED_LABEL = "named hard values at the buffer's ends and power-of-two and shard boundaries"
