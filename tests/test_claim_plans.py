"""A claim never shortens the plan (issue 44): a hook that claims a reduce dtype or a parameter dtype is collected
on every case a hook without a claim is, on every API and at every depth; where the native reference for the
claim cannot run here, the case is there, skipped with its reason.

The walkthrough that found it: an FSDP2 comm claiming ``reduce_dtype=torch.float32`` got 22 cases where the same
comm with no claim got 33 (``apis/fsdp2/plan.py`` mapped any claim to a short plan).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.spec import HookSpec
from conformance.signatures import SpecError
from tests.meta_helpers import plan_settings


class _Comm:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        return None


def _fsdp_hook(state, grad, output=None):
    return None


def _ddp_hook(state, bucket):
    return None


def _all_reduce_hook(tensor):
    return None


def _replica_hook(state, tensor):
    return None


#: A hook of each API, with the state it needs.
HOOKS = {"fsdp": (_fsdp_hook, lambda pg: pg), "ddp": (_ddp_hook, lambda pg: pg), "fsdp2": (_Comm, None),
         "fsdp2_all_reduce": (_all_reduce_hook, None), "fsdp2_replica": (_replica_hook, lambda pg: pg),
         "fsdp2_all_gather": (_Comm, None)}
REDUCE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = (None, torch.bfloat16)


def _spec(api, name, reduce_dtype=None, param_dtype=None):
    hook, state = HOOKS[api]
    return HookSpec(name=name, api=api, hook=hook, state=state, reduce_dtype=reduce_dtype, param_dtype=param_dtype)


def _claims(api):
    """Every claim the API takes (a spec it refuses is not a claim of it)."""
    out = []
    for reduce_dtype, param_dtype in itertools.product(REDUCE_DTYPES, PARAM_DTYPES):
        if reduce_dtype is None and param_dtype is None:
            continue
        try:
            out.append(_spec(api, "claimed", reduce_dtype, param_dtype))
        except SpecError:
            continue
    return out


def _shape(case):
    return (case.check, case.variant, case.model, case.rule, case.world_size, case.nodes)


def _cases(spec, settings):
    return {_shape(c): c for api in HOOK_APIS.values() for test in api.plans
            for c in planned_cases(test, [spec], settings)}


def test_every_api_takes_some_claim():
    """The test below would prove nothing of an API that takes no claim; the all-gather takes a parameter dtype."""
    assert all(_claims(api) for api in HOOKS), {api: len(_claims(api)) for api in HOOKS}
    assert set(HOOKS) == set(HOOK_APIS)


@pytest.mark.parametrize("depth", ["default", "nightly"])
@pytest.mark.parametrize("api", sorted(HOOKS))
def test_a_claim_is_collected_on_every_case_a_hook_without_one_is(api, depth):
    settings = plan_settings(2, 3, depth=depth)
    plain = _cases(_spec(api, "claimed"), settings)
    assert plain, api
    for claimed in _claims(api):
        got = _cases(claimed, settings)
        missing = sorted(set(plain) - set(got), key=str)
        what = f"reduce_dtype={claimed.reduce_dtype}, param_dtype={claimed.param_dtype}"
        assert not missing, f"{api} {what}: {len(missing)} case(s) of a hook without a claim are not planned: " \
                            f"{missing[:5]}"
        for shape, case in got.items():
            if shape in plain and case.skip and not plain[shape].skip:
                assert case.skip.strip(), (api, what, shape)  # skipped with its reason, never silently


def test_an_fsdp2_float32_claim_under_bfloat16_parameters_is_first_class():
    """torchtitan's default pair: the comm gets float32 gradients of bfloat16 parameters, and every model and
    config of the plan (the walkthrough's 33 cases, not 22)."""
    settings = plan_settings(2, 3)
    plain = _cases(_spec("fsdp2", "c"), settings)
    titan = _cases(_spec("fsdp2", "c", torch.float32, torch.bfloat16), settings)
    assert set(plain) <= set(titan)
    models = {shape[2] for shape in titan}
    assert {"mixture_of_experts", "net_wrapped", "always_wrap_nested", "gradient_probe"} <= models
    configs = {shape[1] for shape in titan}
    assert {"force_sum", "unused_params", "replicate"} <= configs
