"""Bitwise tensor comparison, ULP distance and mismatch reports.

"Equal" in this suite means *bitwise* equal: two tensors are equal when they
have the same dtype, the same shape, (optionally) the same device, and every
element has the same stored bits. The one exception is NaN: any NaN equals any
NaN, whatever its sign and payload. ``+0.0`` and ``-0.0`` are *not* equal
(their ULP distance is 0, and the report says "sign of zero differs").

* :func:`compare_bitwise`: ``None`` when equal, else a small picklable
  :class:`Mismatch` with diagnostics (it travels between rank processes).
* :func:`bits_equal`: elementwise bitwise equality (NaN == NaN).
* :func:`ulp_distance`: elementwise distance in ULPs of the tensors' dtype.

Supported dtypes: float16, bfloat16, float32, float64 and the float8 formats
(compared through int16/int16/int32/int64/int8 bit views), integer dtypes and
bool (compared exactly). Complex, sparse and quantized tensors raise
``TypeError`` (compare ``torch.view_as_real`` views instead).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

__all__ = ["Mismatch", "bits_equal", "compare_bitwise", "ulp_distance"]

#: Signed integer dtype of the same width, used to view floating-point bits.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Floating dtypes with an IEEE-style sign bit, for which the monotone
#: bits-to-integer mapping (and so :func:`ulp_distance`) is valid.
_ULP_DTYPES = frozenset(
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

#: Significant decimal digits that always round-trip, per dtype (max_digits10).
_MAX_DIGITS = {torch.float16: 5, torch.bfloat16: 4, torch.float32: 9}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Why two tensors are not bitwise equal. Plain Python values only (no tensors).

    ``reason`` is the first failed check: ``"dtype"``, ``"shape"``, ``"device"``
    or ``"values"``. Dtypes are strings without the ``torch.`` prefix
    (``"float32"``), devices are ``str(tensor.device)`` (``"cuda:0"``).
    ``numel`` is the element count of ``expected``.

    The remaining fields are filled for ``reason == "values"`` only:

    * ``num_different``: elements whose bits differ (NaN vs NaN is not a difference);
    * ``first_index``: multi-dimensional index of the first differing element in
      row-major order (``()`` for a 0-d tensor);
    * ``actual_value`` / ``expected_value``: the elements at ``first_index``
      (Python ``float``; ``int`` / ``bool`` for integer / bool dtypes);
    * ``actual_bits`` / ``expected_bits``: their raw bits in hex, zero-padded to
      the dtype's width (``"0x3e000001"``; two's complement for integers);
    * ``max_abs_diff``: largest ``|actual - expected|`` (computed in float64) over
      differing elements; ``inf`` where NaN faces a number or an infinity faces
      a different value, or where the difference overflows float64;
    * ``max_ulp_diff``: largest :func:`ulp_distance` over differing elements, in
      ULPs of the dtype (``inf`` where NaN faces a non-NaN). For integer and
      bool dtypes the unit is 1, so it equals ``max_abs_diff``.
    """

    reason: str
    actual_dtype: str
    expected_dtype: str
    actual_shape: Tuple[int, ...]
    expected_shape: Tuple[int, ...]
    actual_device: str
    expected_device: str
    numel: int
    num_different: int = 0
    first_index: Optional[Tuple[int, ...]] = None
    actual_value: Optional[float] = None
    expected_value: Optional[float] = None
    actual_bits: Optional[str] = None
    expected_bits: Optional[str] = None
    max_abs_diff: float = 0.0
    max_ulp_diff: float = 0.0

    def describe(self) -> str:
        """One line for a test failure message.

        ``"dtype float16, but expected float32"``, ``"shape (2, 3), but expected
        (3, 2)"``, ``"device cuda:0, but expected cpu"``, or for values:
        ``"first difference at index (3, 1): got 0.12500001 (0x3e000001), but
        expected 0.125 (0x3e000000); 3 of 128 elements differ; max abs diff
        1.49e-08; max ULP diff 1"``.
        """
        if self.reason == "dtype":
            return f"dtype {self.actual_dtype}, but expected {self.expected_dtype}"
        if self.reason == "shape":
            return f"shape {self.actual_shape}, but expected {self.expected_shape}"
        if self.reason == "device":
            return f"device {self.actual_device}, but expected {self.expected_device}"
        floating = isinstance(self.expected_value, float)
        parts = [
            f"first difference at index {self.first_index}: "
            f"got {_fmt_value(self.actual_value, self.actual_dtype)} ({self.actual_bits}), "
            f"but expected {_fmt_value(self.expected_value, self.expected_dtype)} "
            f"({self.expected_bits})"
        ]
        if floating and self.actual_value == 0.0 and self.expected_value == 0.0:
            parts.append("sign of zero differs")
        parts.append(f"{self.num_different} of {self.numel} elements differ")
        parts.append(f"max abs diff {self.max_abs_diff:.3g}")
        if floating:
            parts.append(f"max ULP diff {_fmt_count(self.max_ulp_diff)}")
        return "; ".join(parts)


def compare_bitwise(
    actual: torch.Tensor, expected: torch.Tensor, *, check_device: bool = True
) -> Optional[Mismatch]:
    """Compare two tensors bit for bit; ``None`` when equal, else a :class:`Mismatch`.

    Checks, in order: dtype, shape, device (skipped when ``check_device`` is
    false; the values are then compared on the CPU), then the bits of every
    element (any NaN equals any NaN; ``-0.0`` differs from ``+0.0``). Works for
    any shape including 0-d and empty, non-contiguous tensors, tensors that
    require grad (detached) and accelerator tensors (the equality check runs on
    the device; the diagnostics are computed on the CPU).

    Raises ``TypeError`` for non-tensors and for complex, sparse or quantized
    tensors, ``ValueError`` when values must be compared on the ``meta`` device.
    """
    for name, t in (("actual", actual), ("expected", expected)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"compare_bitwise: {name} is {type(t).__name__}, not a torch.Tensor")
    fields = dict(
        actual_dtype=dtype_name(actual.dtype),
        expected_dtype=dtype_name(expected.dtype),
        actual_shape=tuple(actual.shape),
        expected_shape=tuple(expected.shape),
        actual_device=str(actual.device),
        expected_device=str(expected.device),
        numel=expected.numel(),
    )
    if actual.dtype != expected.dtype:
        return Mismatch("dtype", **fields)
    if actual.shape != expected.shape:
        return Mismatch("shape", **fields)
    if check_device and actual.device != expected.device:
        return Mismatch("device", **fields)

    a, b = _prepare(actual, "compare_bitwise"), _prepare(expected, "compare_bitwise")
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:  # fast path for the common case: identical bits
        int_dtype = _INT_OF_SIZE[a.element_size()]
        if torch.equal(a.view(int_dtype), b.view(int_dtype)):
            return None
    equal = bits_equal(a, b)
    if bool(equal.all()):
        return None

    a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)  # row-major flat views
    differ = ~equal.cpu().reshape(-1)
    first = int(differ.to(torch.uint8).argmax())  # argmax returns the first maximum
    da, db = a[differ], b[differ]
    abs_diff = (da.double() - db.double()).abs()
    abs_diff = torch.where(torch.isnan(abs_diff), math.inf, abs_diff)  # NaN vs number
    max_abs = float(abs_diff.max())
    if a.dtype.is_floating_point:
        max_ulp = float(ulp_distance(da, db).max()) if a.dtype in _ULP_DTYPES else math.nan
    else:
        max_ulp = max_abs
    return Mismatch(
        "values",
        **fields,
        num_different=int(differ.sum()),
        first_index=_unravel(first, tuple(actual.shape)),
        actual_value=a[first].item(),
        expected_value=b[first].item(),
        actual_bits=_hex_bits(a[first]),
        expected_bits=_hex_bits(b[first]),
        max_abs_diff=max_abs,
        max_ulp_diff=max_ulp,
    )


def bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise equality, NaN == NaN (any sign and payload).

    ``actual`` and ``expected`` must have the same dtype, shape and device
    (``ValueError`` otherwise; no broadcasting). Returns a bool tensor of that
    shape on that device. Floating dtypes compare their raw bits (so
    ``-0.0 != +0.0``); integer and bool dtypes compare values. Raises
    ``TypeError`` for complex, sparse or quantized tensors.
    """
    _check_pair(actual, expected, "bits_equal")
    a, b = _prepare(actual, "bits_equal"), _prepare(expected, "bits_equal")
    if not a.dtype.is_floating_point:
        return a == b
    int_dtype = _INT_OF_SIZE[a.element_size()]
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
        if isinstance(t, torch.Tensor) and t.dtype not in _ULP_DTYPES:
            raise TypeError(f"ulp_distance: unsupported dtype {dtype_name(t.dtype)}")
    _check_pair(actual, expected, "ulp_distance")
    a, b = _prepare(actual, "ulp_distance"), _prepare(expected, "ulp_distance")
    nbits = 8 * a.element_size()
    int_dtype = _INT_OF_SIZE[a.element_size()]
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


# --- helpers -----------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: how every message names a dtype."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _check_pair(actual: torch.Tensor, expected: torch.Tensor, fn: str) -> None:
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


def _prepare(t: torch.Tensor, fn: str) -> torch.Tensor:
    """Detached strided tensor whose storage holds the logical values."""
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{fn}: only dense (strided, non-quantized) tensors are supported")
    if t.is_complex():
        raise TypeError(f"{fn}: complex tensors are not supported; compare torch.view_as_real views")
    if t.is_meta:
        raise ValueError(f"{fn}: meta tensors have no values to compare")
    return t.detach().resolve_neg()


def _unravel(flat: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    index = []
    for n in reversed(shape):
        flat, rem = divmod(flat, n)
        index.append(rem)
    return tuple(reversed(index))


def _hex_bits(element: torch.Tensor) -> str:
    """Raw bits of a one-element tensor as zero-padded hex (two's complement for ints)."""
    size = element.element_size()
    if element.dtype.is_floating_point:
        value = int(element.view(_INT_OF_SIZE[size]).item())
    else:
        value = int(element.item())
    return f"0x{value & ((1 << (8 * size)) - 1):0{2 * size}x}"


def _fmt_value(value: object, dtype_name: str) -> str:
    """Shortest decimal that round-trips through the dtype, in Python repr style."""
    if not isinstance(value, float) or not math.isfinite(value) or dtype_name == "float64":
        return repr(value)
    dtype = getattr(torch, dtype_name, None)
    for digits in range(1, _MAX_DIGITS.get(dtype, 17) + 1):
        text = f"{value:.{digits}g}"
        if dtype is None or torch.tensor(float(text), dtype=dtype).item() == value:
            return repr(float(text))
    return repr(value)


def _fmt_count(ulps: float) -> str:
    if math.isfinite(ulps) and ulps == int(ulps) and ulps < 2.0**53:
        return str(int(ulps))
    return f"{ulps:.6g}"
