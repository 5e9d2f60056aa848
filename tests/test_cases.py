"""Tests for conformance.cases: case ids, parsing them back, and which cases a spec gets.

Counts are worked out from what each spec serves (its strategies) and the world
sizes asked for, not from the implementation's loops.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.apis.ddp.models import CONFIGS as DDP_CONFIGS
from conformance.apis.fsdp.plan import (CONSISTENCY_MODELS, EXTRA_PARITY_MODELS, LARGE_PROBE, LONG_RUN_MODEL,
                                        ONE_RANK_RUNS_NO_SHARD, PARITY_MODELS, REGISTRATION_RULES)
from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.cases import CaseParams, case_id, parse_case_id
from conformance.spec import FSDP_STRATEGIES, HookSpec
from tests.meta_helpers import plan_settings


def _no_shard(state, grad):
    pass


def _sharded(state, grad, output):
    pass


def _all(state, grad, output=None):
    pass


def make_spec(name, hook):
    return HookSpec(name=name, api="fsdp", hook=hook, state=lambda pg: pg)


NO_SHARD_ONLY = make_spec("ns_only", _no_shard)
SHARDED_ONLY = make_spec("sh_only", _sharded)
EVERYWHERE = make_spec("every.where", _all)
SPECS = [NO_SHARD_ONLY, SHARDED_ONLY, EVERYWHERE]

HOOK_NAMES = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.]*\Z")
STRATEGIES = st.sampled_from(FSDP_STRATEGIES + ("HYBRID",))
# Model names have no '-' (it separates fields); one spelled like a world-size field
# ("ws3") could not be told apart from one when the id has no world size.
MODELS = st.none() | st.from_regex(r"\A[A-Za-z0-9_.]+\Z").filter(lambda m: not (m[:2] == "ws" and m[2:].isdigit()))
WORLD_SIZES = st.none() | st.integers(min_value=1, max_value=4096)


# -- ids ---------------------------------------------------------------------------------------


def test_training_id_shape():
    assert case_id("my_hook", "FULL_SHARD", model="net_wrapped", world_size=3) == "my_hook-FULL_SHARD-net_wrapped-ws3"
    assert case_id("my_hook", "NO_SHARD", world_size=2) == "my_hook-NO_SHARD-ws2"


def test_registration_id_has_the_rule_and_no_world_size():
    assert case_id("my_hook", "HYBRID", rule="hybrid_strategy_raises", world_size=2) == \
        "my_hook-HYBRID-hybrid_strategy_raises"


def test_hook_name_comes_first_so_one_pattern_selects_one_hook():
    ids = [c.id for c in planned_cases("test_parity", SPECS, plan_settings(2, 3))]
    for spec in SPECS:
        mine = [i for i in ids if i.startswith(spec.name + "-")]
        assert mine and all(parse_case_id(i)["hook"] == spec.name for i in mine)
    # "ns_only-" cannot select another hook whose name merely starts with "ns_only".
    longer = make_spec("ns_only_v2", _no_shard)
    assert not any(c.id.startswith("ns_only-") for c in planned_cases("test_averaging", [longer], plan_settings(2)))


def _case(hook, variant, world_size, *, api="fsdp", check="parity", **fields):
    """A case as the plan of ``api``'s suite test of ``check`` makes it."""
    return HOOK_APIS[api].suite_test(check).case(hook, variant, world_size, **fields)


def test_case_params_id_is_case_id():
    c = _case("h", "FULL_SHARD", 3, model="net_flat")
    assert c.id == case_id("h", "FULL_SHARD", model="net_flat", world_size=3)
    r = _case("h", "NO_SHARD", 2, check="registration", rule="non_root_raises")
    assert r.id == "h-NO_SHARD-non_root_raises"


def test_describe_reports_only_what_the_case_has():
    assert _case("h", "NO_SHARD", 2, check="averaging").describe() == {"check": "averaging", "api": "fsdp",
                                                                         "strategy": "NO_SHARD"}
    assert _case("h", "NO_SHARD", 2, model="m").describe()["model"] == "m"
    assert "model" not in _case("h", "NO_SHARD", 2, check="registration", rule="r").describe()


def test_a_case_has_no_default_api_check_or_variant_field():
    """Only its API's plan makes a case; one made by hand without them says what is missing and where from."""
    with pytest.raises(ValueError, match="h-NO_SHARD-ws2 has no api and no check and no variant_field: a case is "
                                         r"made by its API's plan, SuiteTest.case\(\.\.\.\)"):
        CaseParams("h", "NO_SHARD", 2)
    with pytest.raises(ValueError, match="has no check"):
        CaseParams("h", "NO_SHARD", 2, api="fsdp", variant_field="strategy")


def test_every_planned_case_carries_its_api_check_and_variant_field():
    """What the reports read (api, check, the variant's field) is set by the plan of the suite test that ran it."""
    specs = [EVERYWHERE, _ddp("d"), _comm("c")]
    for api in HOOK_APIS.values():
        for name, test in api.plans.items():
            for case in planned_cases(name, specs, _settings([2, 3])):
                assert (case.api, case.check, case.variant_field) == (api.name, test.check, api.variant_field)
                assert case.check_params()[api.variant_field] == case.variant
                assert HOOK_APIS[case.api].suite_test(case.check) is test


def test_an_unknown_check_names_the_apis_checks():
    with pytest.raises(KeyError, match="api 'ddp' has no suite test of check 'registration'; its checks: averaging"):
        HOOK_APIS["ddp"].suite_test("registration")


# -- parsing ---------------------------------------------------------------------------------------


def test_parse_full_test_name():
    assert parse_case_id("test_parity[h-FULL_SHARD-net_wrapped-ws3]") == {
        "hook": "h", "variant": "FULL_SHARD", "detail": "net_wrapped", "world_size": 3}


def test_parse_node_id_and_dotted_hook_name():
    fields = parse_case_id("conformance/suite/test_fsdp.py::test_averaging[pkg.mod.hook-NO_SHARD-ws2]")
    assert fields == {"hook": "pkg.mod.hook", "variant": "NO_SHARD", "world_size": 2}


def test_parse_registration_id():
    assert parse_case_id("test_registration[h-HYBRID-hybrid_strategy_raises]") == {
        "hook": "h", "variant": "HYBRID", "detail": "hybrid_strategy_raises"}


@pytest.mark.parametrize("text", ["", "just_a_hook", "test_parity[h]"])
def test_text_without_a_strategy_is_not_a_case_id(text):
    with pytest.raises(ValueError, match="not a case id"):
        parse_case_id(text)


def test_ws_without_digits_is_detail_not_a_world_size():
    assert parse_case_id("h-NO_SHARD-wsx") == {"hook": "h", "variant": "NO_SHARD", "detail": "wsx"}


@given(hook=HOOK_NAMES, strategy=STRATEGIES, model=MODELS, world_size=WORLD_SIZES)
def test_parse_inverts_case_id(hook, strategy, model, world_size):
    text = case_id(hook, strategy, model=model, world_size=world_size)
    fields = parse_case_id(text)
    assert fields["hook"] == hook
    assert fields["variant"] == strategy
    assert fields.get("detail") == (model or None)
    assert fields.get("world_size") == world_size
    # ...also inside a pytest test name.
    assert parse_case_id(f"test_parity[{text}]") == fields


@given(hook=HOOK_NAMES, strategy=STRATEGIES, rule=st.sampled_from(REGISTRATION_RULES),
       world_size=st.integers(1, 64))
def test_parse_inverts_registration_ids(hook, strategy, rule, world_size):
    fields = parse_case_id(case_id(hook, strategy, rule=rule, world_size=world_size))
    assert fields == {"hook": hook, "variant": strategy, "detail": rule}


# -- which cases exist ------------------------------------------------------------------------------


def _settings(world_sizes):
    return plan_settings(world_sizes[0], world_sizes[1] if len(world_sizes) > 1 else None)


@pytest.mark.parametrize("world_sizes", [[2], [2, 3], [4, 1]])
@pytest.mark.parametrize("test", ["test_averaging", "test_hard_inputs"])
def test_training_cases_are_every_served_strategy_at_every_world_size(world_sizes, test):
    got = [c for c in planned_cases(test, SPECS, _settings(world_sizes)) if c.model != LARGE_PROBE]
    served = sum(len(spec.strategies) for spec in SPECS)  # 1 + 2 + 3
    assert served == 6
    assert len(got) == served * len(world_sizes)
    assert len({c.id for c in got}) == len(got)
    for spec in SPECS:
        mine = {(c.variant, c.world_size) for c in got if c.hook == spec.name}
        assert mine == set(itertools.product(spec.strategies, world_sizes))
    assert all(c.model is None and c.rule is None for c in got)
    # With one rank FSDP runs NO_SHARD whatever the strategy: those cases are skipped, and only those.
    assert {(c.variant, c.world_size) for c in got if c.skip} == {
        (c.variant, 1) for c in got if c.world_size == 1 and c.variant != "NO_SHARD"}
    assert all(c.skip == ONE_RANK_RUNS_NO_SHARD for c in got if c.skip)


def test_parity_models_per_world_size_role():
    """Every served strategy runs every parity model of its world size's role; the long runs, the topology cases
    and the hard inputs of production size run once per calling convention (NO_SHARD, the first sharded
    strategy)."""
    got = planned_cases("test_parity", [EVERYWHERE, NO_SHARD_ONLY], _settings([2, 3]))
    one_node = [c for c in got if c.nodes == 1]
    long_runs = {(c.hook, c.variant) for c in planned_cases("test_long_run", [EVERYWHERE, NO_SHARD_ONLY],
                                                            _settings([2, 3]))}
    assert long_runs == {("every.where", "NO_SHARD"), ("every.where", "FULL_SHARD"), ("ns_only", "NO_SHARD")}
    assert {c.model for c in planned_cases("test_long_run", [EVERYWHERE], _settings([2, 3]))} == {LONG_RUN_MODEL}
    assert len(one_node) == (3 + 1) * (len(PARITY_MODELS) + len(EXTRA_PARITY_MODELS))
    assert {c.model for c in one_node if c.world_size == 2} == set(PARITY_MODELS)
    assert {c.model for c in one_node if c.world_size == 3} == set(EXTRA_PARITY_MODELS)
    large = {(c.hook, c.variant, c.world_size)
             for c in planned_cases("test_hard_inputs", [EVERYWHERE, NO_SHARD_ONLY], _settings([2, 3]))
             if c.model == LARGE_PROBE}
    assert large == {(h, v, ws) for h, v in long_runs for ws in (2, 3)}
    two_nodes = {(c.hook, c.variant, c.world_size) for c in got if c.nodes == 2}
    assert two_nodes == {(h, v, ws) for h, v in long_runs for ws in (2, 4)}


def test_nightly_depth_runs_every_strategy_and_world_size_at_length():
    nightly = plan_settings(2, 3, depth="nightly")
    got = planned_cases("test_long_run", [EVERYWHERE], nightly)
    assert {(c.variant, c.world_size) for c in got} == set(itertools.product(FSDP_STRATEGIES, (2, 3)))
    assert {c.world_size for c in planned_cases("test_parity", [EVERYWHERE], nightly) if c.nodes == 2} == {2, 4, 8}


def test_every_api_plans_a_long_run_for_each_exact_spec():
    """256 steps at the default depth, 2,000 at nightly: the rank check's parameters say so."""
    from conformance.apis import LONG_RUN_STEPS

    assert LONG_RUN_STEPS["default"]["steps"] >= 256 and LONG_RUN_STEPS["nightly"]["steps"] >= 2000
    for api in HOOK_APIS.values():
        tests = [t for t in api.plans.values() if t.rank_check == "long_run"]
        assert len(tests) == 1, api.name
        assert tests[0].params_at("default")["steps"] == LONG_RUN_STEPS["default"]["steps"]
        assert tests[0].params_at("nightly")["steps"] == LONG_RUN_STEPS["nightly"]["steps"]


def test_rank_consistency_keeps_specs_that_serve_no_shard_and_skips_one_rank():
    got = planned_cases("test_rank_consistency", SPECS, _settings([2, 1]))
    assert {c.hook for c in got} == {NO_SHARD_ONLY.name, EVERYWHERE.name}
    assert {c.variant for c in got} == {"NO_SHARD"}
    assert len(got) == 2 * (len(CONSISTENCY_MODELS) + 1)
    assert {c.world_size for c in got if c.skip} == {1}
    assert all("at least 2 ranks" in c.skip for c in got if c.skip)


def test_a_one_gpu_run_checks_one_world_size_cases_on_its_first_cross_rank_pool():
    """On a one-GPU machine (world sizes 1 on NCCL, then 2 and 3 on CPU pools) a lossy contract's training
    loss and determinism run at 2 ranks, as on a CPU machine: at 1 rank the mean is the local gradient."""
    from conformance.spec import LossyContract

    one_gpu = plan_settings(1, 3, backend="nccl", device="cuda", gpu_count=1, cpu_pools=(2, 3))
    lossy = HookSpec(name="lossy", api="ddp", hook=lambda state, bucket: None, state=lambda pg: pg,
                     lossy=LossyContract(rel_error_bound=0.5, loss_margin=0.5, deterministic=True))
    from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter

    comm = HookSpec(name="lossy2", api="fsdp2", hook=PlainReduceScatter, lossy=LossyContract(rel_error_bound=0.5,
                    loss_margin=0.5, deterministic=True))
    fsdp = dataclasses.replace(make_spec("lossy3", _all), lossy=LossyContract(rel_error_bound=0.5, loss_margin=0.5,
                                                                             deterministic=True))
    for api, spec in (("ddp", lossy), ("fsdp2", comm), ("fsdp", fsdp)):
        for test in (t for t in HOOK_APIS[api].plans if "lossy_loss" in t or "lossy_determinism" in t):
            got = [c for c in planned_cases(test, [spec], one_gpu) if c.variant != "hsdp"]
            assert got and {c.world_size for c in got if "hsdp" not in str(c.variant)} == {2}, (api, test, got)
    cpu = plan_settings(2, 3)
    got = planned_cases("test_ddp_lossy_loss", [lossy], cpu)
    assert got and {c.world_size for c in got} == {2}
    # The subgroup cases need 4 ranks: on the one-GPU machine they run on a CPU pool, not skipped for GPUs.
    subgroup = planned_cases("test_subgroup_parity", [make_spec("s", _all)], one_gpu)
    assert subgroup and {c.world_size for c in subgroup} == {4} and not any(c.skip for c in subgroup)


def test_specs_of_other_apis_get_no_fsdp_cases():
    ddp = HookSpec(name="d", api="ddp", hook=lambda state, bucket: None, state=lambda pg: pg)
    for test in HOOK_APIS["fsdp"].plans:
        assert planned_cases(test, [ddp], _settings([2, 3])) == []


def test_registration_cases_put_the_hybrid_rule_once_per_hook():
    got = planned_cases("test_registration", SPECS, _settings([2, 3]))
    other_rules = [r for r in REGISTRATION_RULES if r != "hybrid_strategy_raises"]
    assert "hybrid_strategy_raises" in REGISTRATION_RULES
    for spec in SPECS:
        mine = [c for c in got if c.hook == spec.name]
        hybrid = [c for c in mine if c.rule == "hybrid_strategy_raises"]
        assert len(hybrid) == 1 and hybrid[0].variant == "HYBRID"
        rest = {(c.rule, c.variant) for c in mine if c.rule != "hybrid_strategy_raises"}
        assert rest == set(itertools.product(other_rules, spec.strategies))
    assert len(got) == sum(1 + len(other_rules) * len(s.strategies) for s in SPECS)
    assert all(c.world_size == 2 and c.skip is None for c in got)
    assert len({c.id for c in got}) == len(got)


def test_hybrid_rule_is_skipped_at_one_rank():
    got = planned_cases("test_registration", [EVERYWHERE], _settings([1, 2]))
    assert [c.rule for c in got if c.skip] == ["hybrid_strategy_raises"]


def test_a_world_size_beyond_the_gpus_is_a_skip_that_says_so():
    settings = plan_settings(4, None, backend="nccl", device="cuda", gpu_count=2)
    got = [c for c in planned_cases("test_parity", [EVERYWHERE], settings) if c.world_size > 2]
    assert got and all(c.skip and "needs 4 GPUs" in c.skip for c in got)


def test_every_api_names_its_variant_and_carries_the_same_properties():
    fsdp = _case("h", "FULL_SHARD", 3, model="net_flat")
    ddp = _case("h", "small_buckets", 2, api="ddp", model="nested_wrapped")
    fsdp2 = _case("h", "hsdp", 4, api="fsdp2", check="fsdp2_parity", model="nested_wrapped")
    assert (fsdp.variant_field, ddp.variant_field, fsdp2.variant_field) == ("strategy", "config", "config")
    assert dict(ddp.junit_properties()) == {
        "hook": "h", "api": "ddp", "check": "parity", "variant": "small_buckets", "config": "small_buckets",
        "world_size": 2, "nodes": 1, "model": "nested_wrapped"}
    assert ddp.check_params() == {"config": "small_buckets", "model": "nested_wrapped"}
    for case in (fsdp, ddp, fsdp2):
        props = dict(case.junit_properties())
        assert {"hook", "api", "check", "variant", case.variant_field, "world_size"} <= set(props)
        assert case.describe()[case.variant_field] == case.variant
    assert fsdp2.id == "h-hsdp-nested_wrapped-ws4"


# -- the DDP and FSDP2 plans ----------------------------------------------------------------------


def _ddp(name, **lossy):
    from conformance.spec import LossyContract

    return HookSpec(name=name, api="ddp", hook=lambda state, bucket: None, state=lambda pg: pg,
                    lossy=LossyContract(**lossy) if lossy else None)


def _tests_of(specs, settings):
    return {test: planned_cases(test, specs, settings) for api in HOOK_APIS.values() for test in api.plans}


def test_ddp_exact_hooks_get_parity_and_lossy_hooks_their_contract():
    exact, lossy = _ddp("exact"), _ddp("lossy", rel_error_bound=0.1, deterministic=False)
    got = _tests_of([exact, lossy], _settings([2, 3]))
    hooks = {test: {c.hook for c in cases} for test, cases in got.items()}
    assert hooks["test_ddp_averaging"] == hooks["test_ddp_parity"] == {"exact"}
    assert hooks["test_ddp_lossy_error"] == {"lossy"}
    assert hooks["test_ddp_rank_consistency"] == hooks["test_ddp_future_contract"] == {"exact", "lossy"}
    # Neither a loss margin nor determinism is declared: those checks plan nothing.
    assert got["test_ddp_lossy_loss"] == got["test_ddp_lossy_determinism"] == []
    assert {c.world_size for c in got["test_ddp_future_contract"]} == {2, 3}
    assert {c.world_size for c in got["test_ddp_parity"]} == {2, 3, 4}  # 4: the subgroup and topology cases
    assert [(c.variant, c.nodes) for c in got["test_ddp_parity"] if c.world_size == 4] == [("subgroup", 2),
                                                                                            ("default", 2)]
    assert hooks["test_ddp_long_run"] == {"exact"}
    assert {(c.world_size, c.model) for c in got["test_ddp_long_run"]} == {(2, "nested_wrapped")}
    assert hooks["test_ddp_hard_inputs"] == {"exact"}
    assert {c.variant for c in got["test_ddp_future_contract"]} == set(DDP_CONFIGS) - {"subgroup"}
    assert all(c.api == "ddp" and c.variant_field == "config" for cases in got.values() for c in cases)


def test_ddp_declared_promises_get_their_checks():
    spec = _ddp("lossy", rel_error_bound=0.1, loss_margin=0.05)
    got = _tests_of([spec], _settings([2, 3]))
    assert [c.world_size for c in got["test_ddp_lossy_loss"]] == [2]
    assert [c.world_size for c in got["test_ddp_lossy_determinism"]] == [2]


def test_ddp_cross_rank_checks_skip_one_rank():
    got = _tests_of([_ddp("exact")], _settings([1, 2]))
    for test in ("test_ddp_averaging", "test_ddp_rank_consistency"):
        assert {c.world_size for c in got[test] if c.skip} == {1}, test
    assert not any(c.skip for c in got["test_ddp_parity"])


def _comm(name, reduce_dtype=None):
    class Comm:
        def allocate(self, size, *, dtype, device):
            return None

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return None

    return HookSpec(name=name, api="fsdp2", hook=Comm(), reduce_dtype=reduce_dtype)


def test_fsdp2_runs_hsdp_on_a_pool_of_its_own_when_no_world_size_fits():
    from conformance.apis.fsdp2_common.plan import HSDP_WORLD_SIZE

    got = planned_cases("test_fsdp2_parity", [_comm("c")], _settings([2, 3]))
    assert {c.world_size for c in got if c.variant == "hsdp"} == {HSDP_WORLD_SIZE}
    assert {c.world_size for c in got} == {2, 3, HSDP_WORLD_SIZE}
    got = planned_cases("test_fsdp2_parity", [_comm("c")], _settings([8, 3]))
    assert {c.world_size for c in got if c.variant == "hsdp"} == {8}


def test_fsdp2_skips_say_why():
    from conformance.apis.fsdp2_common.plan import GLOO_PREMUL_SUM
    from conformance.apis.fsdp2_common.build import missing_api

    if missing_api(("set_custom_reduce_scatter", "set_gradient_divide_factor")) is not None:
        pytest.skip("this torch has no FSDP2 custom comms")
    gloo = planned_cases("test_fsdp2_parity", [_comm("c")], _settings([1, 2]))
    assert all("single rank" in c.skip for c in gloo if c.world_size == 1)
    premul = [c for c in gloo if c.world_size == 2 and c.variant == "divide_factor"]
    assert premul and all(c.skip == GLOO_PREMUL_SUM for c in premul)
    nccl = planned_cases("test_fsdp2_parity", [_comm("c")], plan_settings(2, None, backend="nccl", device="cuda",
                                                                           gpu_count=2))
    assert [c for c in nccl if c.variant == "divide_factor"] and not any(c.skip for c in nccl if c.world_size == 2)
    # A one-GPU machine: its NCCL rank is alone, its world size 2 runs gloo on the CPU, so PREMUL_SUM skips there.
    one_gpu = planned_cases("test_fsdp2_parity", [_comm("c")], plan_settings(1, 3, backend="nccl", device="cuda",
                                                                             gpu_count=1, cpu_pools=(2, 3)))
    assert all(c.skip == GLOO_PREMUL_SUM for c in one_gpu if c.world_size == 2 and c.variant == "divide_factor")
    assert [c for c in one_gpu if c.world_size == 2 and c.variant == "divide_factor"]
    # fp16 reduces with SUM, never PREMUL_SUM: it runs on gloo.
    low = planned_cases("test_fsdp2_parity", [_comm("c16", torch.float16)], _settings([2, 3]))
    assert not any(c.skip for c in low if c.world_size in (2, 3))


def test_every_kind_of_case_has_its_runner_and_a_suite_test_says_which():
    from conformance.apis import CASE_KINDS, SuiteTest
    from conformance.controller.case_kinds import KINDS

    assert set(KINDS) == set(CASE_KINDS)
    with pytest.raises(ValueError, match="kind 'exactly' is not one of exact, plain"):
        SuiteTest("fsdp", "strategy", "parity", "parity", lambda test, specs, settings: [], kind="exactly")


def test_an_api_whose_suite_test_makes_another_apis_cases_is_refused():
    from conformance.apis import HookApi, SuiteTest

    def plan(test, specs, settings):
        return []

    with pytest.raises(ValueError, match=r"api 'x' \(variant field 'config'\): its suite test test_x makes cases of api "
                                         r"'y' \(variant field 'config'\)"):
        HookApi("x", "x.register(hook)", "config", False, lambda spec: (), None,
                {"test_x": SuiteTest("y", "config", "x", "parity", plan)}, models="m:M")
    with pytest.raises(ValueError, match="check 'parity' names more than one suite test"):
        HookApi("x", "x.register(hook)", "config", False, lambda spec: (), None,
                {"test_a": SuiteTest("x", "config", "parity", "parity", plan),
                 "test_b": SuiteTest("x", "config", "parity", "parity", plan)}, models="m:M")


class _Recording:
    """Stands for the Runner: records what a suite case asks it to run."""

    def __init__(self, depth="default"):
        self.calls = []
        self.settings = plan_settings(2, None, depth=depth)

    def check(self, request, case, check, rank_check, params, *, across_ranks=False, note=None):
        self.calls.append((check, rank_check, params, across_ranks, note is not None))


@pytest.mark.parametrize("api, check, variant, model, expected", [
    ("fsdp", "subgroup_parity", "FULL_SHARD", "nested_wrapped",
     ("subgroup_parity", "fsdp.parity", {"strategy": "FULL_SHARD", "model": "nested_wrapped", "subgroup": True},
      False, False)),
    ("fsdp", "parity", "NO_SHARD", "net_flat",  # exact: a failure may end with the lossy-contract hint
     ("parity", "fsdp.parity", {"strategy": "NO_SHARD", "model": "net_flat"}, False, True)),
    ("ddp", "rank_consistency", "default", "net_flat",
     ("rank_consistency", "ddp.rank_grads", {"config": "default", "model": "net_flat", "steps": 4}, True, False)),
    ("fsdp2_all_reduce", "fsdp2_all_reduce_hook", "hsdp", "nested_wrapped",
     ("fsdp2_all_reduce_hook", "fsdp2_all_reduce.parity", {"config": "hsdp", "model": "nested_wrapped"}, False,
      False)),
    ("ddp", "lossy_error", "default", "transformer_shared",  # its figure becomes a property: a note
     ("lossy_error", "ddp.lossy_error", {"config": "default", "model": "transformer_shared"}, False, True)),
])
def test_a_suite_case_runs_its_suite_tests_rank_check_with_the_cases_parameters(api, check, variant, model, expected):
    from conformance.controller.case_kinds import run_case

    conform = _Recording()
    run_case(conform, object(), HOOK_APIS[api].suite_test(check).case("h", variant, 2, model=model))
    assert conform.calls == [expected]


@pytest.mark.parametrize("depth, steps", [("default", 256), ("nightly", 2000)])
def test_a_long_run_trains_the_steps_of_its_depth(depth, steps):
    from conformance.controller.case_kinds import run_case

    conform = _Recording(depth)
    run_case(conform, object(), HOOK_APIS["ddp"].suite_test("long_run").case("h", "default", 2, model="nested_wrapped"))
    assert conform.calls == [("long_run", "ddp.long_run", {"config": "default", "model": "nested_wrapped",
                                                           "steps": steps}, False, True)]
