"""Tests for conformance.shared.compare's ULP distance: ``ulp_distance`` at special values (signed zero, NaN,
infinities, subnormals, the float64 extremes), exhaustively for float16 and bfloat16 against an oracle;
``ulp_distance_in`` and ``compare_bitwise``'s ``reduce_dtype`` figure (ULPs of a reduce dtype for values held in
float32); and property tests (stepping, symmetry, additivity).

Expected distances come from ``tests/compare_helpers.py``'s ``oracle_ulp`` on Python integers, not from the
implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conformance.shared.compare import compare_bitwise
from conformance.ulps import bits_equal, ulp_distance, ulp_distance_in
from tests.compare_helpers import FLOATS, INF, NBITS, f32_bits, from_bits, oracle_ulp, step


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
    assert "max ULP diff" not in m.describe() and "no ULP figure: a NaN faces a number" in m.describe()


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


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_ulp_count_across_signs_or_binades_is_not_printed(dtype):
    """Issue 48: values of different signs (984263339 ULPs for an abs diff of 0.005 in float32) or a factor of 2
    apart get no ULP figure, only a reason; one ULP within a binade keeps its figure."""
    m = compare_bitwise(torch.tensor([0.0026], dtype=dtype), torch.tensor([-0.0026], dtype=dtype))
    assert "max ULP diff" not in m.describe() and "no ULP figure: values of different signs" in m.describe()
    assert "no ULP figure" in compare_bitwise(torch.tensor([4.0], dtype=dtype),
                                              torch.tensor([1.0], dtype=dtype)).describe()
    near = torch.nextafter(torch.tensor([1.0], dtype=dtype), torch.tensor([2.0], dtype=dtype))
    assert "max ULP diff 1" in compare_bitwise(near, torch.tensor([1.0], dtype=dtype)).describe()
