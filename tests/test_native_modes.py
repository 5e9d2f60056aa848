"""DDP's two natives and FSDP2's (issue 45), without a run: which cases a spec gets for each, and what a bad
``native_modes`` is told. The runs are ``tests/test_meta_ddp.py``'s (the native-mode zoo) and the outcomes
guard's (PyTorch's ``allreduce_hook`` against each)."""

from __future__ import annotations

import pytest
import torch

from conformance.apis.ddp import native_modes
from conformance.apis.ddp.builtin_hooks import DDP_HOOKS
from conformance.apis.registry import planned_cases
from conformance.spec import HookSpec
from conformance.signatures import SpecError
from tests.meta_helpers import plan_settings


def _hook(state, bucket):
    return None


def _spec(**kwargs):
    return HookSpec(name="mine", api="ddp", hook=_hook, state=lambda pg: pg, **kwargs)


def _parity(spec, settings=None):
    """``{case id: skip reason or None}`` of ``spec``'s parity cases."""
    return {case.id: case.skip for case in planned_cases("test_ddp_parity", [spec], settings or plan_settings())}


def test_a_spec_naming_no_native_is_held_to_the_default_and_told_how_to_name_the_batched_one():
    cases = _parity(_spec())
    batched = {cid: why for cid, why in cases.items() if "-batched_grad_copy-" in cid}
    assert sorted(batched) == ["mine-batched_grad_copy-nested_wrapped-ws2", "mine-batched_grad_copy-nested_wrapped-ws3"]
    assert all("native_modes=('default', 'batched_grad_copy')" in why for why in batched.values())
    assert all(why is None for cid, why in cases.items() if cid not in batched)


@pytest.mark.parametrize("test", ["test_ddp_parity", "test_ddp_long_run", "test_ddp_hard_inputs",
                                  "test_ddp_clip_grad_norm", "test_ddp_future_contract"])
def test_a_spec_meant_for_the_batched_native_runs_every_config_with_it(test):
    """Every case of a spec meant for the batched copy alone runs (DDP with batched_grad_copy=True beside its
    config's options, the models' and the reproducer's business): its default cases in the batched_grad_copy
    config, once where the plan holds the same case already."""
    settings = plan_settings()
    default = {c.id: c.skip for c in planned_cases(test, [_spec()], settings)}
    batched = {c.id: c.skip for c in planned_cases(test, [_spec(native_modes=("batched_grad_copy",))], settings)}
    assert not [cid for cid in batched if "-default-" in cid]
    assert all(why is None for why in batched.values()), batched
    moved = {cid.replace("-default-", "-batched_grad_copy-") for cid, why in default.items() if why is None}
    assert moved == set(batched) and len(batched) <= len(default)


def test_a_spec_meant_for_both_natives_gets_both():
    cases = _parity(_spec(native_modes=("default", "batched_grad_copy")))
    assert all(why is None for why in cases.values())
    assert {"mine-default-nested_wrapped-ws3", "mine-batched_grad_copy-nested_wrapped-ws3"} <= set(cases)


def test_a_batched_only_case_trains_and_reproduces_with_batched_grad_copy():
    """The rank side (``divides``) and the reproducer (``DDP_KWARGS``, ``REFERENCE``) read the same native."""
    from conformance.apis.ddp import standalone
    from conformance.reproducers.writer import _native

    spec = _spec(native_modes=("batched_grad_copy",))
    assert native_modes.divides("static_graph", spec) and not native_modes.divides("static_graph", _spec())
    assert not native_modes.divides("compiled_autograd", spec)  # the python reducer divides anyway
    assert _native(spec) == {"native": "batched_grad_copy"} and _native(_spec()) == {}
    assert _native(_spec(native_modes=("default", "batched_grad_copy"))) == {}
    case = {"variant": {"config": "static_graph"}, "reduce_dtype": None, "native": "batched_grad_copy"}
    constants = standalone.reproducer_constants(case)
    assert constants["DDP_KWARGS"] == {**standalone.CONFIGS["static_graph"], "batched_grad_copy": True}
    assert constants["REFERENCE"] == "DDP with batched_grad_copy=True and no hook"
    plain = standalone.reproducer_constants({**case, "native": None})
    assert "batched_grad_copy" not in plain["DDP_KWARGS"] and plain["REFERENCE"] == "DDP with no hook"


def test_a_reduced_precision_claim_has_its_batched_cases_skipped_not_dropped():
    cases = _parity(_spec(reduce_dtype=torch.float16, native_modes=("default", "batched_grad_copy")))
    batched = [why for cid, why in cases.items() if "-batched_grad_copy-" in cid]
    assert len(batched) == 2 and all(why == native_modes.NATIVE_MODE_CLAIM_NOTE for why in batched)


def test_a_torch_without_the_argument_skips_the_batched_cases_with_its_version(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def without(self, module, device_ids=None, process_group=None):  # a torch before 2.13
        return original(self, module, device_ids=device_ids, process_group=process_group)

    monkeypatch.setattr(DistributedDataParallel, "__init__", without)
    why = reason = native_modes.native_mode_unavailable()
    assert why is not None and torch.__version__ in why and "batched_grad_copy" in why
    cases = _parity(_spec(native_modes=("default", "batched_grad_copy")))
    assert all(why == cases[cid] for cid in cases if "-batched_grad_copy-" in cid)
    alone = _parity(_spec(native_modes=("batched_grad_copy",)))  # every case of it trains the batched copy
    assert alone and all(why == reason for why in alone.values())


def test_pytorch_s_full_precision_builtins_are_checked_against_both_natives():
    named = {spec.name: spec for spec in DDP_HOOKS}
    for name in ("ddp_allreduce_hook", "ddp_cpp_allreduce"):
        cases = _parity(named[name])
        assert [cases[f"{name}-batched_grad_copy-nested_wrapped-ws{n}"] for n in (2, 3)] == [None, None]


@pytest.mark.parametrize("kwargs, words", [
    ({"native_modes": ("batched",)}, "names no native of api 'ddp'; its natives: 'default', 'batched_grad_copy'"),
    ({"native_modes": ()}, "names no native of api 'ddp'"),
])
def test_a_native_its_api_does_not_have_is_a_bad_spec(kwargs, words):
    with pytest.raises(SpecError, match="native_modes") as raised:
        _spec(**kwargs)
    assert words in str(raised.value)


def test_an_api_with_one_native_refuses_native_modes():
    with pytest.raises(SpecError) as raised:
        HookSpec(name="mine", api="fsdp", hook=lambda state, grad: None, state=lambda pg: pg,
                 native_modes=("default",))
    assert "api 'fsdp' has one native" in str(raised.value)


def test_a_single_mode_may_be_given_as_a_string():
    assert _spec(native_modes="batched_grad_copy").native_modes == ("batched_grad_copy",)


class _SumComm:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return None


def _fsdp2(test, **kwargs):
    spec = HookSpec(name="comm", api="fsdp2", hook=_SumComm(), **kwargs)
    return {case.id: case.skip for case in planned_cases(test, [spec], plan_settings())}


@pytest.mark.parametrize("test", ["test_fsdp2_parity", "test_fsdp2_hard_inputs", "test_fsdp2_accumulation",
                                  "test_fsdp2_long_run", "test_fsdp2_clip_grad_norm"])
def test_an_fsdp2_comm_meant_for_the_sum_native_has_its_default_cases_run_there(test):
    """Every default case of a ``sum_no_divide``-only comm becomes that config's, on the same model, world size
    and layout (once where the plan already had it); every other config is skipped with the reason."""
    default = _fsdp2(test)
    summed = _fsdp2(test, native_modes=("sum_no_divide",))
    moved = {cid.replace("-default-", "-sum_no_divide-") for cid in default if "-default-" in cid}
    assert moved and moved <= set(summed)
    assert not [cid for cid in summed if "-default-" in cid]
    others = {cid: why for cid, why in summed.items() if "-sum_no_divide-" not in cid}
    assert all(why for why in others.values()), others
    assert all("meant for FSDP2's sum_no_divide native only" in why or "PREMUL_SUM" in why or "single rank" in why
               or "--extra-world-size" in why for why in others.values()), others
    assert len(summed) == len(set(summed))


def test_an_fsdp2_comm_naming_no_native_is_told_how_to_name_the_sum_one():
    cases = _fsdp2("test_fsdp2_parity")
    summed = {cid: why for cid, why in cases.items() if "-sum_no_divide-" in cid}
    assert sorted(summed) == ["comm-sum_no_divide-gradient_probe-ws3", "comm-sum_no_divide-nested_wrapped-ws2"]
    assert all("native_modes=('default', 'sum_no_divide')" in why for why in summed.values())
    both = _fsdp2("test_fsdp2_parity", native_modes=("default", "sum_no_divide"))
    assert {cid: why for cid, why in both.items() if "-sum_no_divide-" in cid} == dict.fromkeys(summed)


def test_skip_all_reduce_unused_params_is_a_config_both_models_run_and_an_old_torch_skips(monkeypatch):
    """DDP's ``skip_all_reduce_unused_params`` changes what DDP reduces (none of the unused parameters'
    gradients): its ``skip_unused`` parity case trains both models with it; a torch whose DDP lacks the argument
    skips the case with its version, where the reference could not be built."""
    from torch.nn.parallel import DistributedDataParallel
    from conformance.apis.ddp.standalone import CONFIGS

    assert CONFIGS["skip_unused"] == {"find_unused_parameters": True, "skip_all_reduce_unused_params": True}
    assert _parity(_spec())["mine-skip_unused-unused_param-ws2"] is None
    original = DistributedDataParallel.__init__

    def without(self, module, device_ids=None, process_group=None, find_unused_parameters=False,
                batched_grad_copy=False):  # a torch before the argument
        return original(self, module, device_ids=device_ids, process_group=process_group,
                        find_unused_parameters=find_unused_parameters)

    monkeypatch.setattr(DistributedDataParallel, "__init__", without)
    why = _parity(_spec())["mine-skip_unused-unused_param-ws2"]
    assert why == (f"torch {torch.__version__}'s DistributedDataParallel has no skip_all_reduce_unused_params "
                   "argument, which config 'skip_unused' sets")
    assert _parity(_spec())["mine-find_unused-unused_param-ws2"] is None


def test_a_spec_says_which_natives_it_is_held_to():
    """``HookSpec.natives()``: what the verdict line and the JSON's ``hooks[].native_modes`` report."""
    assert _spec().natives() == ("default",)
    assert _spec(native_modes="batched_grad_copy").natives() == ("batched_grad_copy",)
    assert HookSpec(name="f", api="fsdp", hook=lambda state, grad: None, state=lambda pg: pg).natives() == ("default",)


def test_an_fsdp2_comm_meant_for_accumulation_alone_is_checked_in_the_accumulation_test_only():
    """FSDP2's ``accumulation`` native: a comm built for training with ``set_requires_gradient_sync(False)`` on
    every micro-batch but the last runs its accumulation cases and has every other test's skipped, saying where
    it is checked; with ``sum_no_divide`` too, its accumulation cases run in that config."""
    accumulation = _fsdp2("test_fsdp2_accumulation", native_modes=("accumulation",))
    assert accumulation == _fsdp2("test_fsdp2_accumulation")
    assert any(why is None for why in accumulation.values())
    for test in ("test_fsdp2_parity", "test_fsdp2_hard_inputs", "test_fsdp2_long_run", "test_fsdp2_clip_grad_norm"):
        others = _fsdp2(test, native_modes=("accumulation",))
        assert others and all("gradient accumulation only" in why or "single rank" in why or "PREMUL_SUM" in why
                              for why in others.values()), others
    summed = _fsdp2("test_fsdp2_accumulation", native_modes=("sum_no_divide", "accumulation"))
    ran = [cid for cid, why in summed.items() if why is None]
    assert ran and all("-sum_no_divide-" in cid for cid in ran)
    assert all(why for cid, why in summed.items() if "-sum_no_divide-" not in cid)
    assert all("gradient accumulation only" in why or "PREMUL_SUM" in why for why in _fsdp2(
        "test_fsdp2_parity", native_modes=("sum_no_divide", "accumulation")).values())


@pytest.mark.parametrize("reduce_dtype, param_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                       (torch.float64, torch.float32), (torch.float32, torch.bfloat16)])
def test_every_ddp_reference_hook_passes_ddps_own_registration_check(reduce_dtype, param_dtype):
    """The hook DDP's native is given for a reduce-dtype claim (``reference_hook``) passes the check
    ``DistributedDataParallel.register_comm_hook`` makes: no annotation but ``dist.GradBucket`` and
    ``Future[Tensor]`` objects, and a ``__name__``. The cast-allreduce one (float32 and float64 claims, which
    PyTorch has no wrapper for) once failed both: annotated, and nameless."""
    from torch.nn.parallel import DistributedDataParallel

    from conformance.apis.ddp.standalone import reference_hook

    class Refusing:  # what _check_comm_hook uses of the DDP instance
        def _log_and_throw(self, err_type, err_msg):
            raise err_type(err_msg)

    _, hook = reference_hook(reduce_dtype, param_dtype)
    DistributedDataParallel._check_comm_hook(Refusing(), hook)
