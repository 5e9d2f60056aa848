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


def hard_gradients(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> st.SearchStrategy:
    """Per-rank gradient lists: ``result[rank][i]`` has shape ``shapes[i]``, dtype float32."""
    groups = special_values(reduce_dtype)
    specials = [v for vs in groups.values() for v in vs]
    element = st.one_of(
        st.sampled_from(specials),
        st.floats(min_value=-4.0, max_value=4.0, width=32),
        st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
    per_param = [st.lists(element, min_size=_numel(s), max_size=_numel(s)).map(lambda v, s=s: _tensor(v, s))
                 for s in shapes]
    one_rank = st.tuples(*per_param).map(list)
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
