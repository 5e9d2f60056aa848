"""Bitwise tensor comparison, ULP distance and mismatch reports.

"Equal" in this suite means *bitwise* equal: two tensors are equal when they
have the same dtype, the same shape, (optionally) the same device, and every
element has the same stored bits. The one exception is NaN: any NaN equals any
NaN, whatever its sign and payload. ``+0.0`` and ``-0.0`` are *not* equal
(their ULP distance is 0, and the report says "sign of zero differs").

* :func:`compare_bitwise`: ``None`` when equal, else a small picklable
  :class:`Mismatch` with diagnostics (it travels between rank processes).
* the bit views and ULP distances it reports with are :mod:`conformance.ulps`'s
  (:func:`~conformance.ulps.bits_equal`, :func:`~conformance.ulps.ulp_distance`).

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

from conformance.ulps import (INT_OF_SIZE, ULP_DTYPES, bits_equal, dtype_name, prepare, ulp_distance,
                                    ulp_distance_in)

__all__ = ["Mismatch", "compare_bitwise", "same_bits"]

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
        why = self.ulps_not_meaningful() if floating else None
        if why is not None:
            parts.append(f"no ULP figure: {why}")
        elif floating and self.max_ulp_diff_reduce is not None:
            parts.append(f"max ULP diff {_fmt_count(self.max_ulp_diff)} ({self.actual_dtype}), "
                         f"{_fmt_count(self.max_ulp_diff_reduce)} in {self.reduce_dtype}")
        elif floating:
            parts.append(f"max ULP diff {_fmt_count(self.max_ulp_diff)}")
        return "; ".join(parts)

    def ulps_not_meaningful(self) -> Optional[str]:
        """Why :attr:`max_ulp_diff` says nothing a reader can use, or ``None``: a NaN against a number (an
        infinite distance), or values a binade or more apart (one ``1/eps`` of ULPs: of different signs, or one
        at least twice the other), where the count is of every representable value between them, tiny ones
        included (984263339 ULPs for an abs diff of 0.005 across zero). The abs diff then says how far apart."""
        if math.isinf(self.max_ulp_diff) or math.isnan(self.max_ulp_diff):
            return "a NaN faces a number (the abs diff and the values above say what differs)"
        dtype = getattr(torch, self.actual_dtype, None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and \
                self.max_ulp_diff >= 1 / torch.finfo(dtype).eps:
            return ("values of different signs, or a factor of 2 or more apart, where a count of ULPs (every "
                    "representable value between them) says nothing: read the abs diff")
        return None


#: Elements :func:`same_bits` probes (strided) before its full pass, in tensors of more than twice as many.
SAME_BITS_PROBE = 4096


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape and dtype and the same bits, on whatever devices they are
    (what :func:`compare_bitwise` with ``check_device=False`` calls equal: any NaN equals any NaN, ``-0.0`` is not
    ``+0.0``), without the diagnostics it computes for a difference: the diagnosis asks this of every candidate
    cause, over buffers of tens of MiB."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = prepare(a, "same_bits"), prepare(b, "same_bits")
    if x.device != y.device:
        x, y = x.cpu(), y.cpu()
    if x.dtype.is_floating_point and torch.equal(x.view(INT_OF_SIZE[x.element_size()]),
                                                 y.view(INT_OF_SIZE[y.element_size()])):
        return True
    if x.numel() > 2 * SAME_BITS_PROBE:
        # Not the same raw bits, so equal only where NaNs differ in sign or payload. A wrong candidate differs
        # almost everywhere: a strided probe of SAME_BITS_PROBE elements rejects it without the full pass (five
        # passes and three temporaries the size of the buffer); a probe that matches proves nothing, and the full
        # pass below decides.
        fx, fy = x.reshape(-1), y.reshape(-1)
        stride = fx.numel() // SAME_BITS_PROBE
        if not bool(bits_equal(fx[::stride], fy[::stride]).all()):
            return False
    return bool(bits_equal(x, y).all())


#: Tensor types whose ``view(dtype)`` and ``torch.equal`` see their own elements (not a DTensor's local shard).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plainly_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are dense floating tensors of one dtype, shape and device, with the same raw bits:
    what :func:`compare_bitwise` calls equal, decided without its checks (one ``torch.equal``, a few µs)."""
    return (type(a) in _PLAIN and type(b) in _PLAIN and a.layout == torch.strided
            and b.layout == torch.strided and a.dtype == b.dtype and a.dtype.is_floating_point  # never complex
            and a.shape == b.shape and a.device == b.device and not a.is_meta
            and not a.is_neg() and not b.is_neg()
            and torch.equal(a.view(INT_OF_SIZE[a.element_size()]), b.view(INT_OF_SIZE[b.element_size()])))


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
    if _plainly_equal(actual, expected) and (reduce_dtype is None or reduce_dtype in ULP_DTYPES):
        return None  # the common case, every step of a long run: no fields, no checks to build
    for name, t in (("actual", actual), ("expected", expected)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"compare_bitwise: {name} is {type(t).__name__}, not a torch.Tensor")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype in ULP_DTYPES):
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

    a, b = prepare(actual, "compare_bitwise"), prepare(expected, "compare_bitwise")
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:  # fast path for the common case: identical bits
        int_dtype = INT_OF_SIZE[a.element_size()]
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
        max_ulp = float(ulp_distance(da, db).max()) if a.dtype in ULP_DTYPES else math.nan
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
        value = int(element.view(INT_OF_SIZE[size]).item())
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
