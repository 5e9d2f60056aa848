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
* :func:`ulp_distance_in`: elementwise distance in ULPs of another floating
  dtype (a hook's reduce dtype), for values held in a wider one.

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

__all__ = ["Mismatch", "bits_equal", "compare_bitwise", "ulp_distance", "ulp_distance_in"]

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
      bool dtypes the unit is 1, so it equals ``max_abs_diff``;
    * ``reduce_dtype`` / ``max_ulp_diff_reduce``: when a reduce dtype other than
      the tensors' was given (a hook's ``reduce_dtype`` claim), its name and the
      largest :func:`ulp_distance_in` that dtype over differing elements: the same
      difference counted in the unit the reduction rounded to (a float32
      gradient one bfloat16 step off is 65536 float32 ULPs and 1 bfloat16 ULP).
      ``None`` otherwise.
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
    reduce_dtype: Optional[str] = None
    max_ulp_diff_reduce: Optional[float] = None

    def describe(self) -> str:
        """One line for a test failure message.

        ``"dtype float16, but expected float32"``, ``"shape (2, 3), but expected
        (3, 2)"``, ``"device cuda:0, but expected cpu"``, or for values:
        ``"first difference at index (3, 1): got 0.12500001 (0x3e000001), but
        expected 0.125 (0x3e000000); 3 of 128 elements differ; max abs diff
        1.49e-08; max ULP diff 1"``; with a reduce dtype, the ULP figure in both
        units: ``"max ULP diff 65536 (float32), 1 in bfloat16"``.
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
        if floating and self.max_ulp_diff_reduce is not None:
            parts.append(f"max ULP diff {_fmt_count(self.max_ulp_diff)} ({self.actual_dtype}), "
                         f"{_fmt_count(self.max_ulp_diff_reduce)} in {self.reduce_dtype}")
        elif floating:
            parts.append(f"max ULP diff {_fmt_count(self.max_ulp_diff)}")
        return "; ".join(parts)


def compare_bitwise(
    actual: torch.Tensor, expected: torch.Tensor, *, check_device: bool = True,
    reduce_dtype: Optional[torch.dtype] = None,
) -> Optional[Mismatch]:
    """Compare two tensors bit for bit; ``None`` when equal, else a :class:`Mismatch`.

    Checks, in order: dtype, shape, device (skipped when ``check_device`` is
    false; the values are then compared on the CPU), then the bits of every
    element (any NaN equals any NaN; ``-0.0`` differs from ``+0.0``). Works for
    any shape including 0-d and empty, non-contiguous tensors, tensors that
    require grad (detached) and accelerator tensors (the equality check runs on
    the device; the diagnostics are computed on the CPU).

    ``reduce_dtype`` (a floating dtype, e.g. the ``torch.bfloat16`` a hook
    claims to reduce in) adds the max difference counted in its ULPs
    (``Mismatch.max_ulp_diff_reduce``) to a values mismatch of floating tensors
    of another dtype; it changes nothing about what is equal.

    Raises ``TypeError`` for non-tensors, for complex, sparse or quantized
    tensors and for a ``reduce_dtype`` that is not a floating ``torch.dtype``,
    ``ValueError`` when values must be compared on the ``meta`` device.
    """
    for name, t in (("actual", actual), ("expected", expected)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"compare_bitwise: {name} is {type(t).__name__}, not a torch.Tensor")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype in _ULP_DTYPES):
        raise TypeError(f"compare_bitwise: reduce_dtype must be a floating torch.dtype (float16, bfloat16, ...), "
                        f"got {reduce_dtype!r}")
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
    in_reduce = None
    if a.dtype.is_floating_point:
        max_ulp = float(ulp_distance(da, db).max()) if a.dtype in _ULP_DTYPES else math.nan
        if reduce_dtype is not None and reduce_dtype != a.dtype:
            in_reduce = float(ulp_distance_in(da, db, reduce_dtype).max())
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
        reduce_dtype=None if in_reduce is None else dtype_name(reduce_dtype),
        max_ulp_diff_reduce=in_reduce,
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
    if not (isinstance(dtype, torch.dtype) and dtype in _ULP_DTYPES):
        raise TypeError(f"ulp_distance_in: dtype must be a floating torch.dtype (float16, bfloat16, ...), "
                        f"got {dtype!r}")
    for t in (actual, expected):
        if isinstance(t, torch.Tensor) and t.dtype not in _ULP_DTYPES:
            raise TypeError(f"ulp_distance_in: unsupported dtype {dtype_name(t.dtype)}")
    _check_pair(actual, expected, "ulp_distance_in")
    a = _prepare(actual, "ulp_distance_in").double()
    b = _prepare(expected, "ulp_distance_in").double()
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
