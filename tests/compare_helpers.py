"""Bit patterns for the tests of ``conformance.shared.compare`` (``tests/test_compare.py``,
``tests/test_compare_ulps.py``): tensors made from raw bits, and a ULP distance worked out on Python integers
(an oracle independent of the implementation)."""

from __future__ import annotations

import struct

import torch

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
NBITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}
INF = float("inf")


def from_bits(bits, dtype):
    """Tensor of ``dtype`` with the given raw (unsigned) bit patterns."""
    n = NBITS[dtype]
    signed = [b - (1 << n) if b >= 1 << (n - 1) else b for b in bits]
    return torch.tensor(signed, dtype=INT_VIEW[dtype]).view(dtype)


def raw_bits(t):
    """The raw (unsigned) bit patterns of ``t``, flattened, as Python ints."""
    n = NBITS[t.dtype]
    return [b & ((1 << n) - 1) for b in t.view(INT_VIEW[t.dtype]).reshape(-1).tolist()]


def oracle_ulp(bits_a, bits_b, nbits):
    """Reference ULP distance on raw bit patterns (Python ints, exact); NaN handled by caller."""
    half = 1 << (nbits - 1)

    def key(b):
        return b if b < half else -(b - half)

    return abs(key(bits_a) - key(bits_b))


def f32_bits(x: float) -> int:
    """The bits of ``x`` rounded to float32, as an unsigned int."""
    return struct.unpack(">I", struct.pack(">f", x))[0]


def step(t, k, direction):
    """``t`` moved ``k`` representable values towards ``direction`` (``torch.nextafter``, k times)."""
    for _ in range(k):
        t = torch.nextafter(t, torch.full_like(t, direction))
    return t
