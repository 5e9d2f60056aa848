"""Tests for conformance.spec: HookSpec validation and strategies derived from hook signatures.

The strategies a hook serves are checked against how FSDP calls it: ``hook(state, grad)``
under ``NO_SHARD`` and ``hook(state, grad, output)`` under the sharded strategies, and the
names against ``torch.distributed.fsdp.ShardingStrategy`` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.fsdp import ShardingStrategy

from conformance.spec import HookSpec
from conformance.signatures import FSDP_STRATEGIES, SpecError

SHARDED = {"FULL_SHARD", "SHARD_GRAD_OP"}
ALL = {"NO_SHARD"} | SHARDED


def no_shard_hook(state, grad):
    pass


def sharded_hook(state, grad, output):
    pass


def spec(**overrides):
    fields = dict(name="my_hook", api="fsdp", hook=no_shard_hook, state=default_hooks.DefaultState)
    fields.update(overrides)
    return HookSpec(**fields)


def spec_error(**overrides) -> str:
    with pytest.raises(SpecError) as info:
        spec(**overrides)
    return str(info.value)


# -- what FSDP calls the hook with ------------------------------------------------


def test_strategy_names_are_sharding_strategy_members():
    assert set(FSDP_STRATEGIES) <= {m.name for m in ShardingStrategy}
    assert set(FSDP_STRATEGIES) == ALL


def test_allreduce_hook_serves_no_shard_only():
    s = spec(name="allreduce_hook", hook=default_hooks.allreduce_hook)
    assert set(s.strategies) == {"NO_SHARD"}


def test_reduce_scatter_hook_serves_sharded_strategies_only():
    s = spec(name="reduce_scatter_hook", hook=default_hooks.reduce_scatter_hook)
    assert set(s.strategies) == SHARDED


def test_fp16_compress_hook_with_optional_output_serves_all_three():
    s = spec(name="fp16_compress_hook", hook=default_hooks.fp16_compress_hook,
             state=default_hooks.LowPrecisionState, reduce_dtype=torch.float16)
    assert set(s.strategies) == ALL


def test_derived_strategies_keep_the_declared_order():
    s = spec(hook=default_hooks.fp16_compress_hook)
    assert s.strategies == tuple(n for n in FSDP_STRATEGIES if n in s.strategies)
    assert isinstance(s.strategies, tuple)


def test_callable_object_is_judged_by_its_call_method():
    class NoShard:
        def __call__(self, state, grad):
            pass

    class Sharded:
        def __call__(self, state, grad, output):
            pass

    assert set(spec(hook=NoShard()).strategies) == {"NO_SHARD"}
    assert set(spec(hook=Sharded()).strategies) == SHARDED


def test_partial_is_judged_by_the_arguments_it_still_takes():
    def hook_with_config(config, state, grad, output=None):
        pass

    bound = functools.partial(hook_with_config, {"compress": True})
    assert set(spec(hook=bound).strategies) == ALL
    only_sharded = functools.partial(sharded_hook)
    assert set(spec(hook=only_sharded).strategies) == SHARDED


def test_varargs_hook_serves_every_strategy():
    def anything(*args):
        pass

    assert set(spec(hook=anything).strategies) == ALL


def test_builtin_without_signature_is_assumed_to_serve_every_strategy():
    # inspect.signature cannot read every builtin; the spec then trusts the hook.
    try:
        inspect.signature(max)
    except (TypeError, ValueError):
        pass
    else:  # pragma: no cover - depends on the Python build
        pytest.skip("this Python can inspect max()")
    assert set(spec(hook=max).strategies) == ALL


# -- explicit strategies ------------------------------------------------------------


def test_explicit_subset_of_served_strategies_is_kept():
    s = spec(hook=default_hooks.fp16_compress_hook, strategies=["FULL_SHARD"])
    assert s.strategies == ("FULL_SHARD",)


def test_unknown_strategy_is_refused_with_the_known_names():
    message = spec_error(strategies=("HYBRID_SHARD",))
    assert "'my_hook'" in message
    assert "HYBRID_SHARD" in message
    for name in FSDP_STRATEGIES:
        assert name in message


def test_empty_strategies_are_refused():
    message = spec_error(strategies=())
    assert "'my_hook'" in message
    assert "NO_SHARD" in message


def test_single_strategy_string_is_not_split_into_letters():
    # A lone string is a natural way to name one strategy (known_failures accepts one
    # string for `test` the same way). It must either mean ("NO_SHARD",) or be refused
    # with a message that quotes what the user wrote, never be read letter by letter.
    try:
        s = spec(strategies="NO_SHARD")
    except SpecError as exc:
        assert "'NO_SHARD'" in str(exc), str(exc)
    else:
        assert s.strategies == ("NO_SHARD",)


def test_strategy_the_signature_cannot_serve_names_the_signature_it_needs():
    message = spec_error(hook=default_hooks.allreduce_hook, strategies=("NO_SHARD", "FULL_SHARD"))
    assert "'my_hook'" in message
    assert "FULL_SHARD" in message
    assert "(state, grad, output)" in message
    assert "allreduce_hook" in message

    message = spec_error(hook=default_hooks.reduce_scatter_hook, strategies=("NO_SHARD",))
    assert "(state, grad)" in message
    assert "reduce_scatter_hook" in message


# -- every SpecError names the spec and a fix ----------------------------------------


@pytest.mark.parametrize("name", ["my-hook", "1hook", "", "has space", "a[b]", "mod:attr", "hook\n", "caf\u00e9"])
def test_name_unusable_in_test_ids_is_refused(name):
    message = spec_error(name=name)
    assert repr(name) in message
    assert "letters" in message and "digit" in message


def test_non_string_name_is_refused():
    message = spec_error(name=None)
    assert "None" in message


@given(st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.]*\Z"))
def test_name_made_of_documented_characters_is_accepted(name):
    assert spec(name=name).name == name


def test_unknown_api_is_refused_with_the_known_ones():
    message = spec_error(api="horovod")
    assert "'my_hook'" in message
    assert "'horovod'" in message
    assert "fsdp" in message


def test_non_callable_hook_is_refused_and_the_likely_mistake_named():
    # The usual mistake: hook=my_hook(state, grad) instead of hook=my_hook.
    message = spec_error(hook=None)
    assert "'my_hook'" in message
    assert "not callable" in message
    assert "not the result of calling it" in message


def takes_state_only(state):
    pass


def takes_one_too_many(state, grad, output, extra):
    pass


def needs_a_keyword(state, grad, *, required):
    pass


def takes_nothing():
    pass


@pytest.mark.parametrize("hook", [takes_state_only, takes_one_too_many, needs_a_keyword, takes_nothing])
def test_hook_signature_fitting_no_strategy_is_refused(hook):
    message = spec_error(hook=hook)
    assert "'my_hook'" in message
    assert "(state, grad)" in message and "(state, grad, output)" in message
    assert f"{hook.__name__}{inspect.signature(hook)}" in message  # the offending signature is shown


def test_non_callable_state_is_refused_with_a_factory_hint():
    message = spec_error(state=default_hooks.DefaultState.__new__(default_hooks.DefaultState))
    assert "'my_hook'" in message
    assert "state(process_group)" in message


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.bool, "float16"])
def test_reduce_dtype_fsdp_cannot_reduce_in_is_refused(dtype):
    message = spec_error(reduce_dtype=dtype)
    assert "'my_hook'" in message
    assert repr(dtype) in message
    assert "torch.float16" in message and "torch.bfloat16" in message


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16, torch.float32])
def test_floating_reduce_dtypes_are_accepted(dtype):
    assert spec(reduce_dtype=dtype).reduce_dtype is dtype


def test_reduce_dtype_name_is_the_claim_shown_to_users():
    assert spec().reduce_dtype_name == "full"
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        name = spec(reduce_dtype=dtype).reduce_dtype_name
        assert getattr(torch, name) is dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "bfloat16"])
def test_param_dtype_the_suite_does_not_train_in_is_refused(dtype):
    with pytest.raises(SpecError, match="param_dtype .* torch.bfloat16 or torch.float16"):
        spec(param_dtype=dtype)


def test_param_dtype_claim_is_kept_and_named():
    assert spec().param_dtype_name is None
    claimed = spec(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert (claimed.param_dtype, claimed.param_dtype_name, claimed.reduce_dtype_name) == (
        torch.bfloat16, "bfloat16", "float32")


def test_sample_checks_are_kept_as_a_tuple():
    assert spec(sample_checks=["parity", "accumulation"]).sample_checks == ("parity", "accumulation")
    assert spec().sample_checks is None


def test_the_name_check_runs_before_anything_that_quotes_the_name():
    # A spec that is wrong in several ways reports the name first: every other message
    # quotes the name, so it has to be usable.
    message = spec_error(name="bad-name", api="ddp", hook=None)
    assert "'bad-name'" in message and "not usable in test ids" in message


def test_spec_is_immutable():
    s = spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"  # type: ignore[misc]


def test_spec_error_is_a_value_error():
    # Callers that only know ValueError still catch bad specs.
    assert issubclass(SpecError, ValueError)


def test_importing_the_contract_loads_no_api_plan():
    """``from conformance import HookSpec`` imports neither the registry nor any plan; building a spec does."""
    import subprocess
    import sys

    code = ("import sys, conformance, torch\n"
            "from conformance import HookSpec\n"
            "print(sorted(m for m in sys.modules if m.startswith('conformance.apis')))\n"
            "from torch.distributed.algorithms._comm_hooks import default_hooks\n"
            "HookSpec(name='h', api='fsdp', hook=default_hooks.allreduce_hook, state=default_hooks.DefaultState)\n"
            "print('conformance.apis.registry' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "True"]
