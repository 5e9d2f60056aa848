"""Tests of the reference models in ``models/``, unwrapped: registry, determinism,
rank-dependent inputs, gradients of the plain modules, the gradient probe, and the
production-sized buffers of the large probe. Their FSDP builds are in ``tests/test_models_fsdp.py``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import conformance.models as models
from conformance.models import (
    MODELS,
    PROBE_ROOT_SHAPE,
    PROBE_SHAPES,
    AnalyticLinear,
    GradientProbe,
    ReferenceModel,
    TransformerWithSharedParams,
    get_model,
)
from tests.model_expectations import ALL, EXPECTED_UNITS, gradless
from tests.model_helpers import CPU, bits, plain_build


def _assert_same_tensors(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------


def test_registry_names_and_classes():
    assert set(MODELS) == set(EXPECTED_UNITS)
    for name, cls in MODELS.items():
        assert cls.name == name
        assert issubclass(cls, ReferenceModel)
        assert get_model(name) is cls
        assert cls.__doc__ and "FSDP units" in cls.__doc__
    assert models.NetWrapped.has_wrapping and not models.NetFlat.has_wrapping


def test_get_model_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as info:
        get_model("no_such_model")
    message = str(info.value)
    assert "no_such_model" in message
    for name in MODELS:
        assert name in message


# --------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_build_is_deterministic_and_leaves_global_rng_alone(name):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first = plain_build(name)
    assert torch.equal(torch.get_rng_state(), state), "build changed the global RNG"
    torch.manual_seed(4321)  # a different global state must not matter
    second = plain_build(name)
    sd1, sd2 = first.state_dict(), second.state_dict()
    assert list(sd1) == list(sd2) and sd1
    for key in sd1:
        assert sd1[key].dtype == sd2[key].dtype
        assert torch.equal(bits(sd1[key]) if sd1[key].is_floating_point() else sd1[key],
                           bits(sd2[key]) if sd2[key].is_floating_point() else sd2[key]), key
    # parameters are real random values, not constants; but the large probe's, whose gradients are its inputs
    # whatever its weights (drawing 29 MiB of them per copy would only cost time), and the switch probes', which
    # the long run's regression trains from zero
    if name == "large_probe" or name.startswith("switch_probe"):
        assert all(not p.any() for p in first.parameters())
    else:
        assert any(p.numel() > 1 and p.std() > 0 for p in first.parameters())


@pytest.mark.parametrize("name", ALL)
def test_make_input_depends_on_rank_not_on_global_rng(name):
    cls = MODELS[name]
    torch.manual_seed(7)
    state = torch.get_rng_state()
    a = cls.make_input(0, 2, CPU)
    assert torch.equal(torch.get_rng_state(), state), "make_input changed the global RNG"
    torch.manual_seed(99)
    b = cls.make_input(0, 2, CPU)
    _assert_same_tensors(a, b)
    c = cls.make_input(1, 2, CPU)
    assert len(c) == len(a)
    assert any(not torch.equal(x, y) for x, y in zip(a, c)), "rank 0 and 1 see the same data"
    assert all(isinstance(x, torch.Tensor) and x.device == CPU for x in a)


def test_input_dtypes_and_shapes():
    assert [tuple(x.shape) for x in MODELS["net_wrapped"].make_input(3, 4, CPU)] == [(16, 8)]
    assert [tuple(x.shape) for x in MODELS["nested_wrapped"].make_input(3, 4, CPU)] == [(4, 8)]
    (x,) = AnalyticLinear.make_input(3, 4, CPU)
    assert x.dtype == torch.float32 and x.tolist() == [3.0]
    src, tgt = TransformerWithSharedParams.make_input(1, 2, CPU)
    assert src.shape == (6, 2) and tgt.shape == (4, 2)
    assert src.dtype == tgt.dtype == torch.int64
    assert int(src.min()) >= 0 and int(src.max()) < 23 and int(tgt.max()) < 23
    # rank 0 gets exactly PyTorch's TransformerWithSharedParams.get_input
    src0, tgt0 = TransformerWithSharedParams.make_input(0, 2, CPU)
    assert torch.equal(src0, torch.arange(12).view(6, 2))
    assert torch.equal(tgt0, torch.arange(8).view(4, 2))
    probe = GradientProbe.make_input(2, 4, CPU)
    assert [tuple(t.shape) for t in probe] == GradientProbe.input_shapes()
    assert all(t.dtype == torch.float32 and t.abs().max() <= 1 for t in probe)


# --------------------------------------------------------------------------
# plain (unwrapped) forward and backward
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_plain_forward_backward_reaches_every_parameter(name):
    cls = MODELS[name]
    model = plain_build(name)
    assert isinstance(model, cls)
    inputs = cls.make_input(1, 2, CPU)
    loss = cls.loss(inputs, model(*inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    params = dict(model.named_parameters())
    assert params
    for pname, p in params.items():
        if gradless(cls, pname, p):
            assert p.grad is None, f"{name}: {pname} should get no gradient"
            continue
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        assert p.grad.shape == p.shape
        assert torch.isfinite(p.grad).all()
        assert p.grad.abs().sum() > 0, f"{name}: {pname} got an all-zero gradient"


def test_analytic_linear_gradient_is_rank():
    world_size = 4
    assert AnalyticLinear.expected_grad(world_size) == 1.5
    for rank in range(world_size):
        model = plain_build("analytic_linear", world_size=world_size)
        (weight,) = model.parameters()
        assert weight.shape == (world_size, 1)
        inputs = AnalyticLinear.make_input(rank, world_size, CPU)
        out = model(*inputs)
        assert out.shape == (world_size,)
        AnalyticLinear.loss(inputs, out).backward()
        assert torch.equal(weight.grad, torch.full((world_size, 1), float(rank)))


def test_transformer_shared_weight_buffers_and_eval_mode():
    model = plain_build("transformer_shared")
    assert model.output_proj.weight is model.embed_tokens.weight
    assert isinstance(model.output_proj.weight, nn.Parameter)
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "output_proj.weight" not in names  # deduplicated
    assert len(names) == 68
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(model.vocab_bias, torch.ones(16))
    assert model.long_buffer.dtype == torch.long and torch.equal(
        model.long_buffer, torch.zeros(16, dtype=torch.long)
    )
    assert isinstance(model.bn, nn.BatchNorm1d) and model.bn.num_features == 2
    assert model.transformer.encoder.use_nested_tensor is False
    # eval mode: dropout is off, so forward is a pure function of the input
    inputs = TransformerWithSharedParams.make_input(1, 2, CPU)
    out1, out2 = model(*inputs), model(*inputs)
    assert out1.shape == (4, 2, 23)
    assert torch.equal(out1, out2)


def test_transformer_construction_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_build("transformer_shared")


# --------------------------------------------------------------------------
# gradient probe
# --------------------------------------------------------------------------

_HARD_VALUES = [
    float("nan"),
    float("inf"),
    float("-inf"),
    65504.0,  # fp16 max
    -65504.0,
    65520.0,  # rounds to inf in fp16
    3.3895313892515355e38,  # bf16 max
    torch.finfo(torch.float32).max,
    1e-40,  # float32 subnormal
    -1e-45,
    5.960464477539063e-08,  # smallest fp16 subnormal
    0.0,
    -0.0,
    1.0,
    -3.5,
]


def _hard_inputs():
    flat = torch.tensor(_HARD_VALUES, dtype=torch.float32)
    out = []
    for i, shape in enumerate(GradientProbe.input_shapes()):
        n = math.prod(shape)
        idx = (torch.arange(n) + 3 * i) % flat.numel()
        out.append(flat[idx].view(shape))
    return tuple(out)


def test_probe_shapes_follow_named_parameters_order():
    model = plain_build("gradient_probe")
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    assert shapes == GradientProbe.input_shapes()
    assert shapes == [PROBE_ROOT_SHAPE, *PROBE_SHAPES]
    assert PROBE_SHAPES == ((1,), (5,), (7, 3), (64,))


@pytest.mark.parametrize("inputs", ["hard", "random"])
def test_probe_gradients_are_the_supplied_tensors_bitwise(inputs):
    model = plain_build("gradient_probe")
    grads = _hard_inputs() if inputs == "hard" else GradientProbe.make_input(1, 2, CPU)
    if inputs == "hard":
        flat = torch.cat([g.flatten() for g in grads])
        assert flat.isnan().any() and flat.isinf().any() and (flat == 65504.0).any()
    out = model(*grads)
    loss = GradientProbe.loss(grads, out)
    assert loss is out and loss.dim() == 0
    loss.backward()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(bits(p.grad), bits(g))


def test_probe_rejects_wrong_number_of_tensors():
    model = plain_build("gradient_probe")
    with pytest.raises(ValueError, match="takes 5 tensors"):
        model(*GradientProbe.make_input(0, 1, CPU)[:-1])


# --------------------------------------------------------------------------
# production-sized buffers
# --------------------------------------------------------------------------


def _awkward(n: int) -> bool:
    """A length that is a multiple of no world size of 2 to 4 and of no power of two above 1."""
    return n % 2 == 1 and n % 3 != 0


def test_the_large_probe_fills_ddp_buckets_and_fsdp_units_of_production_size():
    """DDP's rebuilt buckets (in the order the gradients become ready: wide first) are one past the 25 MiB cap
    and one of 1 to 4 MiB; the first iteration's one bucket holds all, wide first. FSDP's flat parameter of
    ``wide`` exceeds 2^22 elements, 2^21 a shard of two. Every length awkward; the probe's gradients are its
    inputs."""
    from conformance.models.large import LARGE_PROBE_SHAPES

    model = MODELS["large_probe"]._construct(1)
    sizes = {name.split(".")[0]: p.numel() for name, p in model.named_parameters()}
    assert list(sizes) == [name for name, _ in LARGE_PROBE_SHAPES] and list(sizes)[0] == "wide"
    mib = 2**20 / 4  # float32 elements in a MiB
    assert sizes["wide"] >= 25 * mib and sizes["wide"] > 2**22 and sizes["wide"] // 2 > 2**21
    assert 1 * mib < sizes["head"] + sizes["tail"] < 4 * mib and sizes["tail"] > 1 * mib
    assert all(_awkward(n) for n in (*sizes.values(), sum(sizes.values())))
    inputs = MODELS["large_probe"].make_input(0, 2, CPU)
    model(*inputs).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), inputs))
