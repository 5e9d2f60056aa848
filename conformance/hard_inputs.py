"""Hypothesis strategies for hard gradient inputs.

Gradients are drawn per rank (so ranks differ) from a mix that stresses a
reduction: values near the reduce dtype's overflow threshold (where FSDP's
pre-divide decides between a finite sum and ``inf``), zeros of both signs,
subnormals of the reduce dtype, NaN, +/-Inf, and ordinary values. They are
float32 tensors (the parameters' dtype); the native path casts them to the
reduce dtype itself.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from hypothesis import strategies as st

Shapes = Sequence[Tuple[int, ...]]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
        "subnormal": [float(info.smallest_normal), subnormal, -subnormal],
        "nonfinite": [float("nan"), float("inf"), float("-inf")],
    }


def _tensor(values: Sequence[float], shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32).reshape(shape)


#: How one generated gradient tensor is filled; "mixed" draws each element from every group.
FILLS = ("ordinary", "near_overflow", "zero", "subnormal", "nonfinite", "mixed")


def fill_tensor(fill: str, seed: int, shape: Tuple[int, ...], reduce_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A float32 tensor of ``shape`` filled the way ``fill`` says, reproducibly from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    n = _numel(shape)
    ordinary = torch.rand(n, generator=gen, dtype=torch.float64).mul(8).sub(4).to(torch.float32)
    if fill == "ordinary":
        return ordinary.reshape(shape)
    groups = special_values(reduce_dtype)
    pool = [v for name, vs in groups.items() for v in vs if fill == "mixed" or name == fill]
    picks = torch.tensor(pool, dtype=torch.float32)[torch.randint(len(pool), (n,), generator=gen)]
    if fill == "mixed":
        use_special = torch.rand(n, generator=gen) < 0.5
        picks = torch.where(use_special, picks, ordinary)
    return picks.reshape(shape)


def hard_gradients(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> st.SearchStrategy:
    """Per-rank gradient lists: ``result[rank][i]`` has shape ``shapes[i]``, dtype float32.

    Hypothesis chooses, per rank and parameter, how the tensor is filled
    (:data:`FILLS`) and a seed; the values follow from those, so an example is
    a handful of choices and stays cheap to draw and to shrink.
    """
    def one(shape: Tuple[int, ...]) -> st.SearchStrategy:
        return st.builds(lambda fill, seed: fill_tensor(fill, seed, shape, reduce_dtype),
                         st.sampled_from(FILLS), st.integers(0, 2**31 - 1))

    one_rank = st.tuples(*[one(s) for s in shapes]).map(list)
    return st.lists(one_rank, min_size=world_size, max_size=world_size)


def explicit_examples(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> Dict[str, list]:
    """Deterministic hard inputs every hard-input case runs first, by name.

    * ``near_overflow``: every rank at 0.75x the reduce dtype's max; the sum of
      two such values overflows unless the hook pre-divides as FSDP does.
    * ``zeros``: +0 on rank 0, -0 elsewhere.
    * ``nan_one_rank``: NaN on rank 0 only, ordinary values elsewhere.
    * ``opposite_infinities``: +Inf on rank 0 and -Inf on rank 1 (NaN after the sum).
    * ``subnormals``: the reduce dtype's subnormals and smallest normal.
    """
    groups = special_values(reduce_dtype)
    big = groups["near_overflow"][0]
    tiny = groups["subnormal"]

    def fill(fn) -> list:
        return [[_tensor([fn(r, i, k) for k in range(_numel(s))], s) for i, s in enumerate(shapes)]
                for r in range(world_size)]

    def ordinary(r: int, i: int, k: int) -> float:
        return float((r + 1) * 0.25 + (i + k) * 0.125)

    return {
        "near_overflow": fill(lambda r, i, k: big if (k + r) % 3 else -big),
        "zeros": fill(lambda r, i, k: 0.0 if r == 0 else -0.0),
        "nan_one_rank": fill(lambda r, i, k: float("nan") if r == 0 and k % 2 == 0 else ordinary(r, i, k)),
        "opposite_infinities": fill(lambda r, i, k: (float("inf") if r == 0 else float("-inf") if r == 1
                                                     else ordinary(r, i, k)) if k % 2 == 0 else ordinary(r, i, k)),
        "subnormals": fill(lambda r, i, k: tiny[(r + k) % len(tiny)]),
    }
