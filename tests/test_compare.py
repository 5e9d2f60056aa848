"""Tests for conformance.shared.compare: bitwise comparison, ULP distance, Mismatch reports.

Expected bit patterns are written out as literals or computed with ``struct``
and Python integers (an oracle independent of the implementation).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import struct
import time

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conformance.shared.compare import Mismatch, bits_equal, compare_bitwise, ulp_distance, ulp_distance_in

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
    n = NBITS[t.dtype]
    return [b & ((1 << n) - 1) for b in t.view(INT_VIEW[t.dtype]).reshape(-1).tolist()]


def oracle_ulp(bits_a, bits_b, nbits):
    """Reference ULP distance on raw bit patterns (Python ints, exact); NaN handled by caller."""
    half = 1 << (nbits - 1)

    def key(b):
        return b if b < half else -(b - half)

    return abs(key(bits_a) - key(bits_b))


def f32_bits(x: float) -> int:
    return struct.unpack(">I", struct.pack(">f", x))[0]


def step(t, k, direction):
    for _ in range(k):
        t = torch.nextafter(t, torch.full_like(t, direction))
    return t


# --- equality ------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", FLOATS + [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool]
)
def test_equal_tensors_give_none(dtype):
    base = (torch.arange(60, dtype=torch.float64).reshape(3, 4, 5) - 30) / 7
    a = base.to(dtype)
    assert compare_bitwise(a, a.clone()) is None
    assert bool(bits_equal(a, a.clone()).all())


def test_equal_special_shapes_and_flags():
    x = torch.randn(4, 6)
    assert compare_bitwise(torch.tensor(2.5), torch.tensor(2.5)) is None  # 0-d
    assert compare_bitwise(torch.empty(0, 3), torch.empty(0, 3)) is None  # empty
    assert compare_bitwise(x.t(), x.t().contiguous()) is None  # non-contiguous
    assert compare_bitwise(x[:, ::2], x[:, ::2].clone()) is None
    g = x.clone().requires_grad_(True)
    assert compare_bitwise(g * 1, x) is None  # requires_grad / grad_fn


def test_nan_payloads_and_signs_are_equal():
    # quiet NaN, signalling NaN, negative NaN with payload, max-payload NaN
    nans32 = from_bits([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF], torch.float32)
    other32 = from_bits([0xFFFFFFFF, 0x7FC12345, 0x7FC00000, 0xFF800001], torch.float32)
    assert raw_bits(nans32) != raw_bits(other32)
    assert bool(torch.isnan(nans32).all()) and bool(torch.isnan(other32).all())
    assert compare_bitwise(nans32, other32) is None
    assert bits_equal(nans32, other32).tolist() == [True] * 4
    assert ulp_distance(nans32, other32).tolist() == [0.0] * 4
    for dtype, a_bits, b_bits in [
        (torch.float16, [0x7E00, 0x7C01], [0xFE01, 0x7FFF]),
        (torch.bfloat16, [0x7FC0, 0x7F81], [0xFFC1, 0x7FFF]),
        (torch.float64, [0x7FF8000000000000, 0x7FF0000000000001], [0xFFF8000000000123, 0x7FFFFFFFFFFFFFFF]),
    ]:
        a, b = from_bits(a_bits, dtype), from_bits(b_bits, dtype)
        assert bool(torch.isnan(a).all()) and bool(torch.isnan(b).all())
        assert compare_bitwise(a, b) is None, dtype


# --- one-ULP differences -----------------------------------------------------------

# dtype -> (bits of 0.125, bits of the next value up)
ONE_EIGHTH_BITS = {
    torch.float16: ("0x3000", "0x3001"),
    torch.bfloat16: ("0x3e00", "0x3e01"),
    torch.float32: ("0x3e000000", "0x3e000001"),
    torch.float64: ("0x3fc0000000000000", "0x3fc0000000000001"),
}


@pytest.mark.parametrize("dtype", FLOATS)
def test_one_ulp_difference(dtype):
    expected = torch.full((4, 5, 3), 0.125, dtype=dtype)
    actual = expected.clone()
    actual[2, 3, 1] = torch.nextafter(actual[2, 3, 1], torch.tensor(1.0, dtype=dtype))
    m = compare_bitwise(actual, expected)
    assert m is not None and m.reason == "values"
    assert m.num_different == 1
    assert m.numel == 60
    assert m.first_index == (2, 3, 1)
    assert m.max_ulp_diff == 1
    assert m.max_abs_diff == actual[2, 3, 1].item() - 0.125 > 0
    assert (m.expected_bits, m.actual_bits) == ONE_EIGHTH_BITS[dtype]
    assert m.expected_value == 0.125 and m.actual_value == actual[2, 3, 1].item() > 0.125
    assert m.actual_dtype == m.expected_dtype == str(dtype).replace("torch.", "")
    assert m.actual_shape == m.expected_shape == (4, 5, 3)
    text = m.describe()
    assert "index (2, 3, 1)" in text and ONE_EIGHTH_BITS[dtype][1] in text
    assert "1 of 60 elements differ" in text and "max ULP diff 1" in text
    assert "sign of zero" not in text
    assert ulp_distance(actual, expected).sum().item() == 1


def test_describe_float32_exact_text():
    expected = torch.full((8, 16), 0.125)
    actual = expected.clone()
    for idx in [(3, 1), (5, 0), (7, 15)]:
        actual[idx] = torch.nextafter(actual[idx], torch.tensor(1.0))
    m = compare_bitwise(actual, expected)
    assert m.describe() == (
        "first difference at index (3, 1): got 0.12500001 (0x3e000001), but expected "
        "0.125 (0x3e000000); 3 of 128 elements differ; max abs diff 1.49e-08; max ULP diff 1"
    )


def test_first_index_is_row_major_for_non_contiguous():
    storage = torch.zeros(4, 3)
    expected = storage.t()  # shape (3, 4); logical (i, j) lives at storage (j, i)
    actual = expected.clone().t().contiguous().t()  # same non-contiguous layout
    assert not actual.is_contiguous()
    actual[1, 0] = 1.0  # storage offset 1: first in memory order
    actual[0, 3] = 2.0  # storage offset 9: first in row-major order
    m = compare_bitwise(actual, expected)
    assert m.first_index == (0, 3)
    assert m.actual_value == 2.0 and m.num_different == 2


def test_counts_ignore_nan_pairs_and_max_over_differences():
    expected = torch.tensor([1.0, float("nan"), 3.0, 4.0, 0.0])
    actual = torch.tensor([1.0, float("nan"), 3.5, 4.0, 0.25])
    m = compare_bitwise(actual, expected)
    assert m.num_different == 2
    assert m.first_index == (2,)
    assert m.max_abs_diff == 0.5
    assert m.max_ulp_diff == f32_bits(0.25)  # 0.0 -> 0.25 beats 3.0 -> 3.5
    assert m.max_ulp_diff == ulp_distance(actual, expected).max().item()


# --- special values ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_signed_zero_differs_with_zero_ulp(dtype):
    actual = torch.tensor([[1.0, -0.0]], dtype=dtype)
    expected = torch.tensor([[1.0, 0.0]], dtype=dtype)
    assert not bool(bits_equal(actual, expected)[0, 1])
    m = compare_bitwise(actual, expected)
    assert m is not None and m.reason == "values"
    assert m.first_index == (0, 1) and m.num_different == 1
    assert m.max_ulp_diff == 0 and m.max_abs_diff == 0
    assert m.actual_bits == "0x8" + "0" * (NBITS[dtype] // 4 - 1)
    assert "sign of zero differs" in m.describe()
    assert ulp_distance(actual, expected).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_vs_number_is_infinite(dtype):
    actual = torch.tensor([1.0, float("nan")], dtype=dtype)
    expected = torch.tensor([1.0, 1.0], dtype=dtype)
    m = compare_bitwise(actual, expected)
    assert m.first_index == (1,)
    assert m.max_ulp_diff == INF and m.max_abs_diff == INF
    assert math.isnan(m.actual_value)
    assert ulp_distance(actual, expected).tolist() == [0.0, INF]
    assert ulp_distance(expected, actual).tolist() == [0.0, INF]
    assert "max ULP diff inf" in m.describe()


@pytest.mark.parametrize("dtype", FLOATS)
def test_inf_vs_largest_finite_is_one_ulp(dtype):
    big = torch.finfo(dtype).max
    a = torch.tensor([INF, -INF], dtype=dtype)
    b = torch.tensor([big, -big], dtype=dtype)
    assert ulp_distance(a, b).tolist() == [1.0, 1.0]
    m = compare_bitwise(a, b)
    assert m.max_ulp_diff == 1 and m.max_abs_diff == INF and m.num_different == 2


@pytest.mark.parametrize("dtype", FLOATS)
def test_smallest_subnormals(dtype):
    n = NBITS[dtype]
    tiny, neg_tiny = from_bits([1], dtype), from_bits([(1 << (n - 1)) | 1], dtype)
    assert tiny.item() > 0 and neg_tiny.item() == -tiny.item()
    assert ulp_distance(tiny, neg_tiny).item() == 2
    assert ulp_distance(tiny, torch.zeros(1, dtype=dtype)).item() == 1
    assert ulp_distance(neg_tiny, torch.tensor([-0.0], dtype=dtype)).item() == 1
    assert ulp_distance(neg_tiny, torch.zeros(1, dtype=dtype)).item() == 1
    assert compare_bitwise(tiny, neg_tiny).max_ulp_diff == 2


def test_float64_extremes_do_not_overflow():
    f = torch.finfo(torch.float64)
    a = torch.tensor([-f.max, -INF, f.max, 1.0], dtype=torch.float64)
    b = torch.tensor([f.max, INF, -f.max, f.max], dtype=torch.float64)
    d = ulp_distance(a, b)
    assert d.dtype == torch.float64
    max_bits, inf_bits, one_bits = 0x7FEFFFFFFFFFFFFF, 0x7FF0000000000000, 0x3FF0000000000000
    assert d.tolist() == [float(2 * max_bits), float(2 * inf_bits), float(2 * max_bits),
                          float(max_bits - one_bits)]
    assert bool((d > 0).all()) and bool(torch.isfinite(d).all())
    m = compare_bitwise(a, b)
    assert m.max_ulp_diff == float(2 * inf_bits) and m.max_abs_diff == INF


def test_float64_exact_below_2_pow_53():
    # Distances just below 2**53, both across zero and on one side of it.
    lo = (1 << 51) + 3
    hi = (1 << 51) + 5
    neg = (1 << 63) | lo
    a = from_bits([neg, lo, 0], torch.float64)
    b = from_bits([hi, (1 << 53) - 7 + lo, (1 << 53) - 1], torch.float64)
    assert ulp_distance(a, b).tolist() == [float(lo + hi), float((1 << 53) - 7), float((1 << 53) - 1)]
    c = from_bits([1 << 52], torch.float64)
    d = from_bits([(1 << 63) | ((1 << 52) - 1)], torch.float64)
    assert ulp_distance(c, d).item() == 2**53 - 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_exhaustive_against_oracle(dtype):
    n = NBITS[dtype]
    everything = from_bits(list(range(1 << n)), dtype)
    nan = torch.isnan(everything).tolist()
    assert sum(nan) == (2046 if dtype == torch.float16 else 254)
    for ref_bits in [0x0000, 0x8000, 0x3C00 if dtype == torch.float16 else 0x3F80, 0xFBFF, 0x0001]:
        ref = from_bits([ref_bits], dtype).expand(1 << n)
        got = ulp_distance(everything, ref)
        want = [INF if nan[i] else float(oracle_ulp(i, ref_bits, n)) for i in range(1 << n)]
        assert got.tolist() == want
        assert bits_equal(everything, ref).sum().item() == 1  # only the ref itself (not NaN)


def test_half_and_bfloat16_known_bits():
    one_h, max_h, inf_h = torch.tensor([1.0, 65504.0, INF], dtype=torch.float16)
    m = compare_bitwise(max_h.reshape(1), inf_h.reshape(1))
    assert (m.actual_bits, m.expected_bits) == ("0x7bff", "0x7c00")
    assert m.actual_value == 65504.0 and m.max_ulp_diff == 1
    bf = torch.tensor([1.0], dtype=torch.bfloat16)
    bf_next = torch.nextafter(bf, torch.tensor([2.0], dtype=torch.bfloat16))
    m = compare_bitwise(bf_next, bf)
    assert (m.actual_bits, m.expected_bits) == ("0x3f81", "0x3f80")
    assert m.actual_value == 1.0078125 and m.max_abs_diff == 0.0078125
    assert "got 1.01 (0x3f81), but expected 1.0 (0x3f80)" in m.describe()
    assert ulp_distance(one_h.reshape(1), torch.tensor([2.0], dtype=torch.float16)).item() == 1024
    assert ulp_distance(bf, torch.tensor([2.0], dtype=torch.bfloat16)).item() == 128


# --- ULPs of a reduce dtype, for values held in float32 ----------------------------------


def test_one_bfloat16_step_in_float32_reads_one_bfloat16_ulp():
    """The issue's case: a float32 gradient rounded to bfloat16, one bfloat16 step off native."""
    native = torch.tensor([0.1234567, -3.3e-3, 7.0e4]).to(torch.bfloat16)
    hooked = native.clone()
    hooked[1] = torch.nextafter(hooked[1], torch.tensor(-INF, dtype=torch.bfloat16))  # one step away from zero
    m = compare_bitwise(hooked.float(), native.float(), reduce_dtype=torch.bfloat16)
    assert m.max_ulp_diff == 2 ** (23 - 7)  # float32 has 16 more fraction bits than bfloat16
    assert (m.reduce_dtype, m.max_ulp_diff_reduce) == ("bfloat16", 1.0)
    assert m.describe().endswith("; max ULP diff 65536 (float32), 1 in bfloat16")


def test_float16_ulps_follow_its_own_exponent_range():
    """float16's subnormals start where float32 is still normal: a fixed float32-to-float16 ratio would be wrong."""
    smallest_normal = torch.finfo(torch.float16).tiny  # 2**-14
    for value, float32_ulps in [(1.5, 2 ** 13), (smallest_normal / 8, 2 ** 16)]:
        a = torch.tensor([value], dtype=torch.float16)
        b = torch.nextafter(a, torch.tensor([INF], dtype=torch.float16))
        m = compare_bitwise(b.float(), a.float(), reduce_dtype=torch.float16)
        assert (m.max_ulp_diff, m.max_ulp_diff_reduce) == (float32_ulps, 1.0), value


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ulps_in_a_reduce_dtype_agree_with_that_dtype_everywhere(dtype):
    """Every non-NaN value of the dtype, held in float32, against a shuffled partner and against +Inf:
    the distance counted in the dtype equals ulp_distance of the dtype's own values."""
    n = NBITS[dtype]
    everything = from_bits(list(range(1 << n)), dtype)
    values = everything[~torch.isnan(everything)]
    partners = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]
    for other in (partners, torch.full_like(values, INF)):
        assert torch.equal(ulp_distance_in(values.float(), other.float(), dtype), ulp_distance(values, other))


def test_values_between_reduce_dtype_steps_count_fractions():
    one = torch.tensor([1.0])
    halfway = torch.tensor([1.0 + 2.0 ** -8])  # half a bfloat16 step above 1
    assert ulp_distance_in(halfway, one, torch.bfloat16).item() == 0.5
    assert ulp_distance_in(-halfway, one, torch.bfloat16).item() == 2 * 127 * 128 + 0.5  # across zero
    nan = torch.tensor([math.nan])
    assert ulp_distance_in(nan, one, torch.bfloat16).item() == INF
    assert ulp_distance_in(nan, -nan, torch.bfloat16).item() == 0
    assert ulp_distance_in(torch.tensor([-0.0]), torch.tensor([0.0]), torch.float16).item() == 0


def test_a_finite_value_beyond_the_reduce_dtype_is_infinitely_far():
    """float16 cannot hold 65536.0 (it rounds to inf): no count of float16 steps reaches it."""
    got = ulp_distance_in(torch.tensor([65536.0, 65536.0, 65504.0]), torch.tensor([INF, 65504.0, INF]),
                          torch.float16)
    assert got.tolist() == [INF, INF, 1.0]
    assert ulp_distance_in(torch.tensor([65536.0]), torch.tensor([65536.0]), torch.float16).item() == 0


def test_reduce_dtype_figure_only_where_it_adds_a_unit():
    a, b = torch.tensor([1.0]), torch.tensor([1.5])
    assert compare_bitwise(a, b).max_ulp_diff_reduce is None
    m = compare_bitwise(a, b, reduce_dtype=torch.float32)  # the tensors' own dtype: one figure suffices
    assert (m.reduce_dtype, m.max_ulp_diff_reduce) == (None, None) and "(float32)" not in m.describe()
    for bad in ("bfloat16", torch.int8, torch.complex64):
        with pytest.raises(TypeError, match="reduce_dtype must be a floating torch.dtype"):
            compare_bitwise(a, b, reduce_dtype=bad)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        ulp_distance_in(a, b, torch.int32)
    with pytest.raises(ValueError):
        ulp_distance_in(a, b.double(), torch.bfloat16)


# --- dtype / shape / device / integers ------------------------------------------------


def test_dtype_mismatch():
    m = compare_bitwise(torch.zeros(3, dtype=torch.float16), torch.zeros(2, 2))
    assert m.reason == "dtype"  # checked before shape
    assert (m.actual_dtype, m.expected_dtype) == ("float16", "float32")
    assert m.describe() == "dtype float16, but expected float32"
    assert m.num_different == 0 and m.first_index is None


def test_shape_mismatch():
    m = compare_bitwise(torch.zeros(2, 3), torch.zeros(3, 2))
    assert m.reason == "shape" and m.numel == 6
    assert m.describe() == "shape (2, 3), but expected (3, 2)"
    m = compare_bitwise(torch.zeros(()), torch.zeros(1))
    assert m.describe() == "shape (), but expected (1,)"


def test_device_mismatch_and_meta():
    m = compare_bitwise(torch.zeros(2, device="meta"), torch.zeros(2))
    assert m.reason == "device"
    assert (m.actual_device, m.expected_device) == ("meta", "cpu")
    assert m.describe() == "device meta, but expected cpu"
    with pytest.raises(ValueError):
        compare_bitwise(torch.zeros(2, device="meta"), torch.zeros(2), check_device=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors():
    x = torch.randn(64, 32)
    xc = x.cuda()
    assert compare_bitwise(xc, x.clone().cuda()) is None
    m = compare_bitwise(xc, x)
    assert m.reason == "device" and m.actual_device == "cuda:0"
    assert compare_bitwise(xc, x, check_device=False) is None
    yc = xc.clone()
    yc[5, 7] = torch.nextafter(yc[5, 7], torch.tensor(INF, device="cuda"))
    for actual, expected, kw in [(yc, xc, {}), (yc, x, {"check_device": False})]:
        m = compare_bitwise(actual, expected, **kw)
        assert m.first_index == (5, 7) and m.max_ulp_diff == 1 and m.num_different == 1
    assert ulp_distance(yc, xc).sum().item() == 1


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8])
def test_integer_values(dtype):
    expected = torch.tensor([[5, 7], [9, 3]], dtype=dtype)
    actual = expected.clone()
    actual[1, 0] = 1
    m = compare_bitwise(actual, expected)
    assert m.reason == "values" and m.first_index == (1, 0) and m.num_different == 1
    assert (m.actual_value, m.expected_value) == (1, 9)
    width = 2 * torch.tensor([], dtype=dtype).element_size()
    assert (m.actual_bits, m.expected_bits) == ("0x" + "1".zfill(width), "0x" + "9".zfill(width))
    assert m.max_abs_diff == 8
    assert "ULP" not in m.describe() and "max abs diff 8" in m.describe()


def test_integer_bits_are_twos_complement_and_bool():
    m = compare_bitwise(torch.tensor(-1, dtype=torch.int32), torch.tensor(3, dtype=torch.int32))
    assert m.first_index == () and m.actual_bits == "0xffffffff" and m.max_abs_diff == 4
    big = torch.tensor([2**62 + 1], dtype=torch.int64)
    m = compare_bitwise(big, big - 2)
    assert m.actual_value == 2**62 + 1  # ints stay exact in the report
    m = compare_bitwise(torch.tensor([True, False]), torch.tensor([True, True]))
    assert m.first_index == (1,) and (m.actual_bits, m.expected_bits) == ("0x00", "0x01")


def test_argument_errors():
    f32, f64 = torch.zeros(3), torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError):
        bits_equal(f32, f64)
    with pytest.raises(ValueError):
        bits_equal(f32, torch.zeros(4))
    with pytest.raises(ValueError):
        ulp_distance(f32, f64)
    with pytest.raises(ValueError):
        ulp_distance(f32, torch.zeros(1, 3))
    for dtype in (torch.int32, torch.bool, torch.complex64):
        with pytest.raises(TypeError):
            ulp_distance(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype))
    with pytest.raises(TypeError):
        compare_bitwise([1.0], torch.zeros(1))
    with pytest.raises(TypeError):
        compare_bitwise(torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64))


def test_mismatch_is_picklable_and_small():
    a = torch.full((3, 3), 0.5, requires_grad=True)
    b = a.detach().clone()
    b[1, 2] = -0.0
    for m in [compare_bitwise(a, b), compare_bitwise(a, b.half()), compare_bitwise(a, b.t()[:2])]:
        assert m is not None
        clone = pickle.loads(pickle.dumps(m))
        assert clone == m and clone.describe() == m.describe()
        for field in dataclasses.fields(Mismatch):
            value = getattr(m, field.name)
            assert not isinstance(value, torch.Tensor)
            if isinstance(value, tuple):
                assert all(type(i) is int for i in value)
        assert len(pickle.dumps(m)) < 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.reason = "x"


def test_large_tensors_are_fast():
    a = torch.randn(1_000_000)
    b = a.clone()
    b[::3] = torch.nextafter(b[::3], torch.full_like(b[::3], INF))
    start = time.perf_counter()
    m = compare_bitwise(a, b)
    assert compare_bitwise(a, a.clone()) is None
    assert time.perf_counter() - start < 5.0
    assert m.num_different == 333_334 and m.max_ulp_diff == 1 and m.first_index == (0,)


# --- property tests -------------------------------------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32)
finite64 = st.floats(allow_nan=False, allow_infinity=False)


@settings(deadline=None, max_examples=200)
@given(st.lists(finite32, min_size=1, max_size=20), st.integers(0, 12), st.sampled_from([INF, -INF]))
def test_stepping_k_times_is_k_ulps(xs, k, direction):
    x = torch.tensor(xs, dtype=torch.float32)
    one = step(x, 1, INF)
    assert ulp_distance(x, one).tolist() == [1.0] * len(xs)
    y = step(x, k, direction)
    assume(bool(torch.isfinite(y).all()) or k <= 1)
    assert ulp_distance(x, y).tolist() == [float(k)] * len(xs)
    assert ulp_distance(y, x).tolist() == [float(k)] * len(xs)
    m = compare_bitwise(y, x)
    if k == 0:
        assert m is None
    else:  # every step changes the bits, even -0.0 -> smallest subnormal
        assert m.num_different == len(xs) and m.max_ulp_diff == k and m.first_index == (0,)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(any32, any32), min_size=1, max_size=30))
def test_ulp_symmetric_and_matches_oracle(pairs):
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    d = ulp_distance(a, b)
    assert d.tolist() == ulp_distance(b, a).tolist()
    assert ulp_distance(a, a).tolist() == [0.0] * len(pairs)
    for i, (x, y) in enumerate(pairs):
        if math.isnan(x) or math.isnan(y):
            want = 0.0 if (math.isnan(x) and math.isnan(y)) else INF
        else:
            want = float(oracle_ulp(f32_bits(x), f32_bits(y), 32))
        assert d[i].item() == want
    eq = bits_equal(a, b)
    m = compare_bitwise(a, b)
    assert (m is None) == bool(eq.all())
    if m is not None:
        assert m.num_different == int((~eq).sum())


@settings(deadline=None, max_examples=200)
@given(st.lists(finite32, min_size=3, max_size=3))
def test_ulp_additive_along_ordered_triples_float32(xs):
    a, b, c = (torch.tensor([x], dtype=torch.float32) for x in sorted(xs))
    assert ulp_distance(a, c).item() == ulp_distance(a, b).item() + ulp_distance(b, c).item()


@settings(deadline=None, max_examples=200)
@given(st.lists(finite64, min_size=3, max_size=3))
def test_ulp_additive_along_ordered_triples_float64(xs):
    a, b, c = (torch.tensor([x], dtype=torch.float64) for x in sorted(xs))
    ac = ulp_distance(a, c).item()
    ab_bc = ulp_distance(a, b).item() + ulp_distance(b, c).item()
    if ac < 2**53:
        assert ac == ab_bc
    else:
        assert math.isclose(ac, ab_bc, rel_tol=2**-51)
