"""Floating-point bits and ULPs: elementwise bitwise equality and distances in units in the last place.

The primitives :mod:`conformance.shared.compare` builds its mismatch reports on:

* :func:`bits_equal`: elementwise bitwise equality (NaN == NaN);
* :func:`ulp_distance`: elementwise distance in ULPs of the tensors' dtype;
* :func:`ulp_distance_in`: elementwise distance in ULPs of another floating
  dtype (a hook's reduce dtype), for values held in a wider one;
* :func:`dtype_name`: how every message names a dtype.

Supported dtypes: float16, bfloat16, float32, float64 and the float8 formats
(through int16/int16/int32/int64/int8 bit views); integer and bool dtypes for
:func:`bits_equal`. Complex, sparse and quantized tensors raise ``TypeError``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ULP_DTYPES", "bits_equal", "dtype_name", "ulp_distance", "ulp_distance_in"]

#: Signed integer dtype of the same width, used to view floating-point bits.
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Floating dtypes with an IEEE-style sign bit, for which the monotone
#: bits-to-integer mapping (and so :func:`ulp_distance`) is valid.
ULP_DTYPES = frozenset(
    dt
    for dt in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if dt is not None
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: how every message names a dtype."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def check_pair(actual: torch.Tensor, expected: torch.Tensor, fn: str) -> None:
    """Raise ``TypeError`` (not tensors) or ``ValueError`` (another dtype, shape or device), naming ``fn``."""
    for name, t in (("actual", actual), ("expected", expected)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} is {type(t).__name__}, not a torch.Tensor")
    if actual.dtype != expected.dtype:
        raise ValueError(
            f"{fn}: dtype {dtype_name(actual.dtype)}, but expected {dtype_name(expected.dtype)}"
        )
    if actual.shape != expected.shape:
        raise ValueError(f"{fn}: shape {tuple(actual.shape)}, but expected {tuple(expected.shape)}")
    if actual.device != expected.device:
        raise ValueError(f"{fn}: device {actual.device}, but expected {expected.device}")


def prepare(t: torch.Tensor, fn: str) -> torch.Tensor:
    """Detached strided tensor whose storage holds the logical values."""
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{fn}: only dense (strided, non-quantized) tensors are supported")
    if t.is_complex():
        raise TypeError(f"{fn}: complex tensors are not supported; compare torch.view_as_real views")
    if t.is_meta:
        raise ValueError(f"{fn}: meta tensors have no values to compare")
    return t.detach().resolve_neg()


def bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise equality, NaN == NaN (any sign and payload).

    ``actual`` and ``expected`` must have the same dtype, shape and device
    (``ValueError`` otherwise; no broadcasting). Returns a bool tensor of that
    shape on that device. Floating dtypes compare their raw bits (so
    ``-0.0 != +0.0``); integer and bool dtypes compare values. Raises
    ``TypeError`` for complex, sparse or quantized tensors.
    """
    check_pair(actual, expected, "bits_equal")
    a, b = prepare(actual, "bits_equal"), prepare(expected, "bits_equal")
    if not a.dtype.is_floating_point:
        return a == b
    int_dtype = INT_OF_SIZE[a.element_size()]
    return (a.view(int_dtype) == b.view(int_dtype)) | (torch.isnan(a) & torch.isnan(b))


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ULPs of the tensors' dtype, as a float64 tensor.

    The distance is the number of steps between the two values along the
    ordered representable values of the dtype, using the standard monotone
    mapping of IEEE bits to integers (negative values below positive ones,
    ``+0.0`` and ``-0.0`` both map to 0). So adjacent values are 1 apart,
    ``+inf`` is 1 from the largest finite value, and the smallest positive
    subnormal is 2 from its negative. NaN vs NaN is 0; NaN vs non-NaN is
    ``inf``. The result is exact (integral) below ``2**53``; beyond that it is
    rounded to float64 (it never overflows, e.g. for float64 ``-max`` vs
    ``+max``).

    ``actual`` and ``expected`` must have the same floating dtype (float16,
    bfloat16, float32, float64 or a float8 format), shape and device. Returns a
    float64 tensor of that shape on that device. Raises ``TypeError`` for other
    dtypes, ``ValueError`` for mismatched dtype, shape or device.
    """
    for t in (actual, expected):
        if isinstance(t, torch.Tensor) and t.dtype not in ULP_DTYPES:
            raise TypeError(f"ulp_distance: unsupported dtype {dtype_name(t.dtype)}")
    check_pair(actual, expected, "ulp_distance")
    a, b = prepare(actual, "ulp_distance"), prepare(expected, "ulp_distance")
    nbits = 8 * a.element_size()
    int_dtype = INT_OF_SIZE[a.element_size()]
    ia, ib = a.view(int_dtype).long(), b.view(int_dtype).long()  # sign-extended
    magnitude = (1 << (nbits - 1)) - 1
    ma, mb = ia & magnitude, ib & magnitude  # in [0, 2**63 - 1]: no overflow below
    same_sign = (ia < 0) == (ib < 0)
    # Same sign: |ma - mb|, exact in int64. Opposite signs: ma + mb, which may
    # exceed int64 for float64, so add in float64 (exact while below 2**53).
    dist = torch.where(same_sign, (ma - mb).abs().double(), ma.double() + mb.double())
    na, nb = torch.isnan(a), torch.isnan(b)
    dist = torch.where(na & nb, 0.0, dist)
    return torch.where(na ^ nb, math.inf, dist)


def ulp_distance_in(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise distance in ULPs of ``dtype`` between values held in another floating dtype, as float64.

    For values that ``dtype`` represents exactly (a float32 gradient cast back
    from a bfloat16 reduction), this is :func:`ulp_distance` of the values cast
    to ``dtype``: the number of ``dtype`` steps between them, subnormals and
    infinities included (an infinity is one step past ``dtype``'s largest
    finite value). Between two such values, the count grows linearly with the
    value, so a value ``dtype`` cannot represent counts a fraction: half a
    bfloat16 step is 0.5. A finite value beyond ``dtype``'s largest finite
    value has no place among its values (float16 rounds 65536.0 to ``inf``):
    it is ``inf`` from any other value. ``+0.0`` and ``-0.0`` are 0 apart; NaN
    vs NaN is 0, NaN vs non-NaN ``inf``. Exact for float16/bfloat16/float32
    values and a ``dtype`` of at most 24 significand bits (below ``2**53``).

    The distance is the difference of each value's position on ``dtype``'s
    ordered values: for ``|x| = m * 2**e`` with ``m`` in ``[1, 2)``, ``e`` at
    least ``dtype``'s smallest normal exponent ``emin``, that position is
    ``(e - emin + m) * 2**p`` (``p`` fraction bits, ``torch.finfo(dtype).eps ==
    2**-p``), which is the integer value of ``dtype``'s bits where ``x`` is a
    ``dtype`` value; below ``2**emin`` (subnormals) it is ``|x| * 2**(p - emin)``.

    ``actual`` and ``expected`` must have the same floating dtype, shape and
    device (``ValueError`` otherwise); ``dtype`` is a floating ``torch.dtype``
    (``TypeError`` otherwise). Returns a float64 tensor of that shape.
    """
    if not (isinstance(dtype, torch.dtype) and dtype in ULP_DTYPES):
        raise TypeError(f"ulp_distance_in: dtype must be a floating torch.dtype (float16, bfloat16, ...), "
                        f"got {dtype!r}")
    for t in (actual, expected):
        if isinstance(t, torch.Tensor) and t.dtype not in ULP_DTYPES:
            raise TypeError(f"ulp_distance_in: unsupported dtype {dtype_name(t.dtype)}")
    check_pair(actual, expected, "ulp_distance_in")
    a = prepare(actual, "ulp_distance_in").double()
    b = prepare(expected, "ulp_distance_in").double()
    dist = (_position_in(a, dtype) - _position_in(b, dtype)).abs()
    largest = torch.finfo(dtype).max
    beyond = (torch.isfinite(a) & (a.abs() > largest)) | (torch.isfinite(b) & (b.abs() > largest))
    dist = torch.where(beyond & (a != b), math.inf, dist)
    na, nb = torch.isnan(a), torch.isnan(b)
    dist = torch.where(na & nb, 0.0, dist)
    return torch.where(na ^ nb, math.inf, dist)


def _position_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Signed position of each float64 value of ``x`` on ``dtype``'s ordered values (see :func:`ulp_distance_in`)."""
    info = torch.finfo(dtype)
    p = round(-math.log2(info.eps))  # fraction bits
    emin = round(math.log2(info.tiny))  # exponent of the smallest normal value
    emax = math.floor(math.log2(info.max))  # exponent of the largest finite value
    ax = x.abs()
    mantissa, exponent = torch.frexp(ax)  # ax = mantissa * 2**exponent, mantissa in [0.5, 1)
    normal = ((exponent - 1 - emin).double() + 2 * mantissa) * 2.0 ** p
    position = torch.where(ax >= 2.0 ** emin, normal, ax * 2.0 ** (p - emin))
    position = torch.where(torch.isinf(ax), (emax + 2 - emin) * 2.0 ** p, position)
    return torch.copysign(position, x)

