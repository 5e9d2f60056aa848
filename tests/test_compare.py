"""Tests for conformance.shared.compare's bitwise comparison: ``compare_bitwise`` and ``bits_equal``, and the
``Mismatch`` they report (first differing index, counts, bits and text; dtype, shape and device mismatches;
integers; pickling; speed).

The ULP distance itself, at special values, in a reduce dtype and as properties, is in
``tests/test_compare_ulps.py``. Expected bit patterns are written out as literals or computed with ``struct``
and Python integers (an oracle independent of the implementation: ``tests/compare_helpers.py``).
"""

from __future__ import annotations

import dataclasses
import pickle
import time

import pytest
import torch

from conformance.shared.compare import SAME_BITS_PROBE, Mismatch, compare_bitwise, same_bits
from conformance.ulps import bits_equal, ulp_distance
from conformance.ulps import INT_OF_SIZE
from tests.compare_helpers import FLOATS, INF, f32_bits, from_bits, raw_bits


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


# --- same_bits: the diagnosis's yes/no question over large buffers -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("where", ["probed", "between_probes", "last", "nan_payload", "negative_zero"])
def test_same_bits_answers_as_bits_equal_wherever_the_one_difference_lies(dtype, where):
    """``same_bits`` probes a strided sample before its full pass over a large tensor: a difference where the
    probe looks, one between its positions, at the last element, a NaN of another payload (equal) and ``-0.0``
    against ``0.0`` (not equal) each get the answer of the full elementwise comparison."""
    n = 2 * SAME_BITS_PROBE + 1234  # not a multiple of the probe's stride
    a = torch.randn(n, dtype=torch.float64).to(dtype)
    stride = n // SAME_BITS_PROBE
    at = {"probed": 5 * stride, "between_probes": 5 * stride + 1, "last": n - 1,
          "nan_payload": 5 * stride + 1, "negative_zero": 7 * stride}[where]
    b = a.clone()
    if where == "nan_payload":
        a[at] = float("nan")
        bits = b.view(INT_OF_SIZE[b.element_size()])
        bits[at] = a.view(INT_OF_SIZE[a.element_size()])[at] | 1  # another payload, still a NaN
        assert torch.isnan(b[at])
    elif where == "negative_zero":
        a[at], b[at] = 0.0, -0.0
    else:  # the last bit flipped: x * 2 + 1 would leave a randn value of -1.0 (float16, bfloat16) as it was
        bits = b.view(INT_OF_SIZE[b.element_size()])
        bits[at] = bits[at] ^ 1
    want = bool(bits_equal(a, b).all())
    assert want == (where == "nan_payload")
    assert same_bits(a, b) is want and same_bits(b, a) is want
    assert same_bits(a[: SAME_BITS_PROBE], b[: SAME_BITS_PROBE]) is bool(bits_equal(a[: SAME_BITS_PROBE],
                                                                                     b[: SAME_BITS_PROBE]).all())


def test_bits_digest_tells_any_one_bit_apart_and_nothing_else():
    """The digest of native trained twice (``reference_result``): equal for equal bits, different where one
    element differs by one ULP, by the sign of a zero or by a NaN payload, or where a shape or a dtype does."""
    from conformance.ranks.checks.common import bits_digest

    torch.manual_seed(0)
    base = {"w": torch.randn(3, 1000), "b": torch.randn(7).to(torch.bfloat16)}
    same = {k: v.clone() for k, v in base.items()}
    assert bits_digest(base) == bits_digest(same) and len(bits_digest(base)) == 16

    def changed(name, index, value):
        other = {k: v.clone() for k, v in base.items()}
        other[name].view(-1)[index] = value
        return bits_digest(other)

    w = base["w"].view(-1)
    seen = {bits_digest(base),
            changed("w", 2999, torch.nextafter(w[2999], torch.tensor(float("inf")))),
            changed("w", 0, torch.nextafter(w[0], torch.tensor(float("-inf")))),
            changed("b", 3, torch.nextafter(base["b"][3], torch.tensor(float("inf"), dtype=torch.bfloat16))),
            bits_digest({"w": base["w"].reshape(1000, 3), "b": base["b"]}),
            bits_digest({"w": base["w"], "b": base["b"].float()})}
    assert len(seen) == 6
    zeros = torch.zeros(4)
    assert bits_digest({"z": zeros}) != bits_digest({"z": -zeros})
    nan = torch.full((2,), float("nan"))
    payload = nan.clone()
    payload.view(torch.int32)[1] += 1
    assert bits_digest({"n": nan}) == bits_digest({"n": nan.clone()}) != bits_digest({"n": payload})
