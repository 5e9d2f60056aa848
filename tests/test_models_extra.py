"""Tests of the reference models ``nonuniform_req_grad``, ``mixture_of_experts``
and ``unused_param``: determinism, rank-dependent inputs, the frozen set, the
per-rank expert, the unused parameter, and FSDP wrapping in a single-rank gloo
group on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.models import (
    MODELS,
    MixtureOfExperts,
    NonUniformReqGradNWM,
    ReferenceModel,
    UnusedParamModel,
    get_model,
)
from conformance.models import moe as moe_module
from conformance.models.nonuniform import is_trainable_name
from tests.model_expectations import EXPECTED_UNITS
from tests.model_helpers import CPU, bits, plain_build, unwrapped

NEW = ("nonuniform_req_grad", "mixture_of_experts", "unused_param")

TRAINABLE = {"module.2.1.weight", "module.2.1.bias"}
EXPERT = {"module.2.weight", "module.2.bias"}
UNUSED = {"unused.weight", "unused.bias"}


def _backward(name: str, model: nn.Module, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    cls = MODELS[name]
    inputs = cls.make_input(rank, world_size, CPU)
    loss = cls.loss(inputs, model(*inputs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    return loss


# --------------------------------------------------------------------------
# registry, determinism, inputs (plain builds)
# --------------------------------------------------------------------------


def test_registry_has_the_new_models():
    assert get_model("nonuniform_req_grad") is NonUniformReqGradNWM
    assert get_model("mixture_of_experts") is MixtureOfExperts
    assert get_model("unused_param") is UnusedParamModel
    for name in NEW:
        cls = MODELS[name]
        assert cls.name == name and issubclass(cls, ReferenceModel)
        assert cls.fsdp_units == len(EXPECTED_UNITS[name])
        assert cls.__doc__ and "FSDP units" in cls.__doc__


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("rank", [0, 1])
def test_build_is_deterministic_and_leaves_global_rng_alone(name, rank):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first = plain_build(name, rank)
    assert torch.equal(torch.get_rng_state(), state), "build changed the global RNG"
    torch.manual_seed(4321)
    second = plain_build(name, rank)
    sd1, sd2 = first.state_dict(), second.state_dict()
    assert list(sd1) == list(sd2) and sd1
    for key in sd1:
        assert torch.equal(bits(sd1[key]), bits(sd2[key])), key
    assert all(p.numel() > 1 and p.std() > 0 for n, p in first.named_parameters() if "weight" in n)
    req1 = {n: p.requires_grad for n, p in first.named_parameters()}
    assert req1 == {n: p.requires_grad for n, p in second.named_parameters()}


@pytest.mark.parametrize("name", NEW)
def test_make_input_depends_on_rank_not_on_global_rng(name):
    cls = MODELS[name]
    torch.manual_seed(7)
    state = torch.get_rng_state()
    (a,) = cls.make_input(0, 2, CPU)
    assert torch.equal(torch.get_rng_state(), state), "make_input changed the global RNG"
    torch.manual_seed(99)
    (b,) = cls.make_input(0, 2, CPU)
    (c,) = cls.make_input(1, 2, CPU)
    assert torch.equal(a, b)
    assert not torch.equal(a, c), "rank 0 and 1 see the same data"
    assert a.shape == (4, 8) and a.dtype == torch.float32 and a.device == CPU
    assert 0 <= float(a.min()) and float(a.max()) < 1


@pytest.mark.parametrize(
    "name, out_shape", [("nonuniform_req_grad", (4, 8)), ("mixture_of_experts", (4, 8)),
                        ("unused_param", (4, 4))]
)
def test_output_shapes(name, out_shape):
    model = plain_build(name)
    (x,) = MODELS[name].make_input(0, 2, CPU)
    assert model(x).shape == out_shape


# --------------------------------------------------------------------------
# nonuniform_req_grad
# --------------------------------------------------------------------------


def test_nonuniform_plain_freezes_all_but_module_2_1():
    model = plain_build("nonuniform_req_grad")
    params = dict(model.named_parameters())
    assert len(params) == 10
    assert {n for n, p in params.items() if p.requires_grad} == TRAINABLE
    assert [tuple(params[n].shape) for n in sorted(TRAINABLE)] == [(8,), (8, 4)]
    _backward("nonuniform_req_grad", model, rank=1, world_size=2)
    for n, p in params.items():
        if n in TRAINABLE:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


@pytest.mark.parametrize(
    "pname, expected",
    [
        ("module.2.1.weight", True),
        ("module.2._fsdp_wrapped_module.1.bias", True),
        ("_fsdp_wrapped_module.module.2._fsdp_wrapped_module.1.weight", True),
        ("module.2.0.weight", False),
        ("module.2._fsdp_wrapped_module.0.bias", False),
        ("module.1.1.weight", False),
        ("_fsdp_wrapped_module.module.1._fsdp_wrapped_module.1.bias", False),
        ("module.0.weight", False),
    ],
)
def test_nonuniform_trainable_pattern(pname, expected):
    assert is_trainable_name(pname) is expected


# --------------------------------------------------------------------------
# mixture_of_experts (plain)
# --------------------------------------------------------------------------


def test_moe_expert_differs_across_ranks_shared_does_not():
    rank0, rank1 = plain_build("mixture_of_experts", 0), plain_build("mixture_of_experts", 1)
    p0, p1 = dict(rank0.named_parameters()), dict(rank1.named_parameters())
    assert list(p0) == list(p1) and len(p0) == 8
    assert {n for n, p in p0.items() if getattr(p, "expert", False)} == EXPERT
    assert rank0.num_expert_params == 23 * 12 + 12
    assert tuple(p0["module.2.weight"].shape) == (12, 23)
    assert tuple(p0["module.1.weight"].shape) == (23, 12)
    for n in p0:
        same = torch.equal(p0[n], p1[n])
        assert same is (n not in EXPERT), n
    # the expert is a function of the rank only, not of the world size
    other = plain_build("mixture_of_experts", 1, world_size=5)
    assert torch.equal(dict(other.named_parameters())["module.2.weight"], p1["module.2.weight"])


def test_moe_plain_backward_reaches_every_parameter():
    model = plain_build("mixture_of_experts", 1)
    _backward("mixture_of_experts", model, rank=1, world_size=2)
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_moe_expert_group_needs_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="initialized default process group"):
        MixtureOfExperts.expert_group(None)


# --------------------------------------------------------------------------
# unused_param (plain)
# --------------------------------------------------------------------------


def test_unused_param_gets_no_grad():
    model = plain_build("unused_param")
    params = dict(model.named_parameters())
    assert list(params) == [
        "fc1.weight", "fc1.bias", "unused.weight", "unused.bias", "fc2.weight", "fc2.bias"
    ]
    assert set(UnusedParamModel.unused_parameter_names) == UNUSED
    _backward("unused_param", model, rank=1, world_size=2)
    for n, p in params.items():
        if n in UNUSED:
            assert p.grad is None, n
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, n


# --------------------------------------------------------------------------
# FSDP wrapping (single-rank gloo group, CPU)
# --------------------------------------------------------------------------
# Their FSDP units are checked with every other model's: tests/test_models_fsdp.py.


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD"])
def test_fsdp_forward_backward_matches_plain_model(fsdp1, name, strategy):
    plain = plain_build(name, rank=0, world_size=1)
    wrapped = fsdp1.build(name, strategy)
    plain_params = dict(plain.named_parameters())
    wrapped_params = {unwrapped(n): p for n, p in wrapped.named_parameters()}
    assert set(wrapped_params) == set(plain_params)
    for pname, p in plain_params.items():
        assert torch.equal(wrapped_params[pname].detach(), p.detach()), pname
        assert wrapped_params[pname].requires_grad == p.requires_grad, pname
    plain_loss = _backward(name, plain)
    wrapped_loss = _backward(name, wrapped)
    torch.testing.assert_close(wrapped_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for pname, p in plain_params.items():
        g = wrapped_params[pname].grad
        if p.grad is None:  # frozen or unused: FSDP1 leaves None or an all-zero grad
            assert g is None or not g.any(), pname
        else:
            assert g is not None, f"{name}: {pname} got no gradient under FSDP"
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=pname)


def test_fsdp_nonuniform_trainable_set_and_use_orig_params_required(fsdp1):
    from torch.distributed.fsdp import ShardingStrategy

    model = fsdp1.build("nonuniform_req_grad", "FULL_SHARD")
    trainable = {unwrapped(n) for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == TRAINABLE
    for bad in ({}, {"use_orig_params": False}, {"use_orig_params": 1}):
        kwargs = dict(bad, sharding_strategy=ShardingStrategy.NO_SHARD)
        with pytest.raises(ValueError, match="use_orig_params=True"):
            NonUniformReqGradNWM.build(group=fsdp1.group, device=CPU, fsdp_kwargs=kwargs)
    # the plain build needs no FSDP kwargs at all
    assert isinstance(NonUniformReqGradNWM.build(group=fsdp1.group, device=CPU, fsdp_kwargs=None),
                      NonUniformReqGradNWM)


def test_fsdp_nonuniform_training_moves_only_module_2_1(fsdp1):
    model = fsdp1.build("nonuniform_req_grad")
    before = {unwrapped(n): p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _backward("nonuniform_req_grad", model)
    opt.step()
    changed = {
        unwrapped(n) for n, p in model.named_parameters() if not torch.equal(p, before[unwrapped(n)])
    }
    assert changed == TRAINABLE


def test_fsdp_moe_expert_unit_uses_singleton_group(fsdp1):
    FSDP = fsdp1.FSDP
    model = fsdp1.build("mixture_of_experts")
    expert_group = MixtureOfExperts.expert_group(fsdp1.group)
    assert expert_group is not fsdp1.group and expert_group.size() == 1
    units = {unwrapped(n): m for n, m in model.named_modules() if isinstance(m, FSDP)}
    assert units["module.2"].process_group is expert_group
    assert units["module.1"].process_group is fsdp1.group
    assert units[""].process_group is fsdp1.group
    expert = {unwrapped(n) for n, p in model.named_parameters() if getattr(p, "expert", False)}
    assert expert == EXPERT
    # repeated builds reuse the cached groups instead of creating new ones
    again = fsdp1.build("mixture_of_experts", "FULL_SHARD")
    again_units = {unwrapped(n): m for n, m in again.named_modules() if isinstance(m, FSDP)}
    assert again_units["module.2"].process_group is expert_group
    assert moe_module._singleton_groups() == [expert_group]


def test_fsdp_moe_flat_param_marked_expert(fsdp1):
    model = fsdp1.build("mixture_of_experts", use_orig_params=False)
    flat = dict(model.named_parameters())
    marked = {n for n, p in flat.items() if getattr(p, "expert", False)}
    assert len(flat) == 3 and len(marked) == 1
    assert unwrapped(marked.pop()) == "module.2._flat_param"


def test_fsdp_moe_rejects_reserved_kwargs(gloo_group):
    with pytest.raises(TypeError, match="process_group"):
        MixtureOfExperts.build(group=gloo_group, device=CPU, fsdp_kwargs={"process_group": gloo_group})


def test_fsdp2_moe_apply_fully_shard(gloo_group):
    import torch.distributed.fsdp as fsdp_pkg

    if not hasattr(fsdp_pkg, "fully_shard"):
        # torch < 2.6 has FSDP2 only as torch.distributed._composable.fsdp; its
        # CPU/gloo support is not verified here
        pytest.skip("this torch has no public torch.distributed.fsdp.fully_shard")
    fully_shard = moe_module._fully_shard_fn()
    from torch.distributed.device_mesh import DeviceMesh

    if not hasattr(DeviceMesh, "from_group"):
        pytest.skip("this torch has no DeviceMesh.from_group")
    assert fully_shard is fsdp_pkg.fully_shard
    plain = plain_build("mixture_of_experts", rank=0, world_size=1)
    model = MixtureOfExperts.apply_fully_shard(
        MixtureOfExperts.build(group=gloo_group, device=CPU, fsdp_kwargs=None), group=gloo_group, device=CPU
    )
    _backward("mixture_of_experts", plain)
    _backward("mixture_of_experts", model)
    expert_param = model.module[2].weight
    assert expert_param.device_mesh.get_group() is MixtureOfExperts.expert_group(gloo_group)
    for (n, p), (pn, pp) in zip(model.named_parameters(), plain.named_parameters()):
        assert n == pn
        torch.testing.assert_close(p.grad.full_tensor(), pp.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_late_branch_runs_its_branch_on_the_last_micro_batch_only():
    """Micro-batch k of a step is seeded rank + k * world_size; only the last (the synchronising one) takes
    the branch, so its parameters' first gradient of the step comes on the backward that reduces."""
    from conformance.models import ACCUMULATION_MICRO_STEPS, LateBranchModel

    world_size = 3
    for rank in range(world_size):
        model = LateBranchModel._construct(world_size)
        for k in range(ACCUMULATION_MICRO_STEPS):
            inputs = LateBranchModel.make_input(rank + k * world_size, world_size, torch.device("cpu"))
            LateBranchModel.loss(inputs, model(*inputs)).backward()
            last = k == ACCUMULATION_MICRO_STEPS - 1
            assert bool(inputs[1]) is last
            assert (model.branch.weight.grad is not None) is last
            assert model.trunk.weight.grad is not None
