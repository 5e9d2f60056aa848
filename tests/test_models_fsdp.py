"""Tests of the FSDP1 builds of the reference models in ``models/``, each wrapped in a single-rank gloo group
on CPU (the ``gloo_group`` and ``fsdp1`` fixtures of ``tests/conftest.py``): the FSDP units match PyTorch's
wrapping, forward and backward match the plain model, comm hooks register on every unit, mixed precision, and
the keyword arguments a build refuses or leaves alone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from conformance.models import MODELS, GradientProbe, TransformerWithSharedParams
from tests.model_expectations import ALL, EXPECTED_UNITS, gradless
from tests.model_helpers import CPU, plain_build, unwrapped


# --------------------------------------------------------------------------
# FSDP wrapping (single-rank gloo group, CPU)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_fsdp_units_match_pytorch_wrapping(fsdp1, name):
    FSDP = fsdp1.FSDP
    model = fsdp1.build(name)
    assert isinstance(model, FSDP)
    units = FSDP.fsdp_modules(model)
    assert units[0] is model
    assert len(units) == len(EXPECTED_UNITS[name]) == MODELS[name].fsdp_units
    assert fsdp1.unit_paths(model) == EXPECTED_UNITS[name]
    expert = units[0].module.module[2] if name == "mixture_of_experts" else None
    for unit in units:
        if unit is expert:  # the expert unit is over this rank's singleton group
            assert unit.process_group is MODELS[name].expert_group(fsdp1.group)
        else:
            assert unit.process_group is fsdp1.group
        assert unit.compute_device == CPU


@pytest.mark.parametrize("name", ALL)
def test_fsdp_forward_backward_matches_plain_model(fsdp1, name):
    cls = MODELS[name]
    plain = plain_build(name, world_size=1)
    wrapped = fsdp1.build(name)
    plain_params = dict(plain.named_parameters())
    wrapped_params = {
        unwrapped(n): p for n, p in wrapped.named_parameters()
    }
    assert set(wrapped_params) == set(plain_params)
    for pname, p in plain_params.items():  # same initial values as the plain build
        assert torch.equal(wrapped_params[pname].detach(), p.detach()), pname

    inputs = cls.make_input(0, 1, CPU)
    plain_loss = cls.loss(inputs, plain(*inputs))
    wrapped_loss = cls.loss(inputs, wrapped(*inputs))
    assert wrapped_loss.dim() == 0 and torch.isfinite(wrapped_loss)
    torch.testing.assert_close(wrapped_loss, plain_loss, rtol=1e-6, atol=1e-6)
    plain_loss.backward()
    wrapped_loss.backward()
    for pname, p in plain_params.items():
        g = wrapped_params[pname].grad
        if gradless(cls, pname, p):  # FSDP1 leaves None or an all-zero gradient
            assert p.grad is None and (g is None or not g.any()), pname
            continue
        assert g is not None, f"{name}: {pname} got no gradient under FSDP"
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=pname)


def test_fsdp_probe_gradients_are_the_supplied_tensors(fsdp1):
    model = fsdp1.build("gradient_probe")
    grads = GradientProbe.make_input(0, 1, CPU)
    GradientProbe.loss(grads, model(*grads)).backward()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_fsdp_comm_hook_registers_on_every_unit(fsdp1):
    from torch.distributed.algorithms._comm_hooks import default_hooks

    FSDP = fsdp1.FSDP
    model = fsdp1.build("nested_wrapped", use_orig_params=False)
    state = default_hooks.DefaultState(process_group=fsdp1.group)
    model.register_comm_hook(state, default_hooks.allreduce_hook)
    units = FSDP.fsdp_modules(model)
    assert len(units) == 4
    assert all(u._comm_hook is default_hooks.allreduce_hook for u in units)


def test_fsdp_transformer_with_mixed_precision(fsdp1):
    from torch.distributed.fsdp import MixedPrecision

    FSDP = fsdp1.FSDP
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        # FSDP warns that it wraps BatchNorm separately under mixed precision
        warnings.simplefilter("ignore", UserWarning)
        model = fsdp1.build("transformer_shared", mixed_precision=mp)
    # BatchNorm becomes its own (full-precision) unit: one more than usual
    assert len(FSDP.fsdp_modules(model)) == TransformerWithSharedParams.fsdp_units + 1
    assert "bn" in fsdp1.unit_paths(model)
    inputs = TransformerWithSharedParams.make_input(1, 2, CPU)
    out = model(*inputs)
    assert out.dtype == torch.bfloat16
    loss = TransformerWithSharedParams.loss(inputs, out)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp_caller_auto_wrap_policy_overrides_default(fsdp1):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    FSDP = fsdp1.FSDP
    model = fsdp1.build("transformer_shared", auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}))
    assert len(FSDP.fsdp_modules(model)) == 3


def test_fsdp_build_rejects_reserved_kwargs(gloo_group):
    with pytest.raises(TypeError, match="device_id"):
        MODELS["net_flat"].build(group=gloo_group, device=CPU, fsdp_kwargs={"device_id": CPU})
    with pytest.raises(TypeError, match="process_group"):
        MODELS["net_flat"].build(group=gloo_group, device=CPU, fsdp_kwargs={"process_group": gloo_group})


def test_build_does_not_mutate_caller_kwargs(gloo_group):
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    kwargs = {"sharding_strategy": ShardingStrategy.NO_SHARD, "auto_wrap_policy": policy}
    MODELS["transformer_shared"].build(group=gloo_group, device=CPU, fsdp_kwargs=kwargs)
    assert kwargs == {"sharding_strategy": ShardingStrategy.NO_SHARD, "auto_wrap_policy": policy}
