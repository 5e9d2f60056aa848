"""Tests for the case plans: which cases each API's plan makes for a spec (``planned_cases``): every served
strategy at every world size, the parity models of each world size's role, long runs and their depth, the
registration rules, the skips and why, a one-GPU machine's pools; the DDP and FSDP2 plans.

Counts are worked out from what each spec serves (its strategies) and the world
sizes asked for, not from the implementation's loops.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conformance.apis.ddp.standalone import CONFIGS as DDP_CONFIGS
from conformance.apis.fsdp.plan import (CONSISTENCY_MODELS, EXTRA_PARITY_MODELS, LARGE_PROBE, LONG_RUN_MODEL,
                                        ONE_RANK_RUNS_NO_SHARD, PARITY_MODELS, REGISTRATION_RULES)
from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.spec import HookSpec
from conformance.signatures import FSDP_STRATEGIES
from tests.case_helpers import EVERYWHERE, NO_SHARD_ONLY, SPECS, any_strategy_hook, make_spec
from tests.meta_helpers import plan_settings


# -- which cases exist ------------------------------------------------------------------------------


def _settings(world_sizes):
    return plan_settings(world_sizes[0], world_sizes[1] if len(world_sizes) > 1 else None)


def test_every_planned_case_carries_its_api_check_and_variant_field():
    """What the reports read (api, check, the variant's field) is set by the plan of the suite test that ran it."""
    specs = [EVERYWHERE, _ddp("d"), _comm("c")]
    for api in HOOK_APIS.values():
        for name, test in api.plans.items():
            for case in planned_cases(name, specs, _settings([2, 3])):
                assert (case.api, case.check, case.variant_field) == (api.name, test.check, api.variant_field)
                assert case.check_params()[api.variant_field] == case.variant
                assert HOOK_APIS[case.api].suite_test(case.check) is test


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
    """256 steps at the default depth, 2,000 at nightly at the main world size (256 at the others): the rank
    check's parameters say so."""
    from conformance.apis import LONG_RUN_STEPS

    assert LONG_RUN_STEPS["default"]["steps"] >= 256 and LONG_RUN_STEPS["nightly"]["steps"] >= 2000
    for api in HOOK_APIS.values():
        tests = [t for t in api.plans.values() if t.rank_check == "long_run" and t.kind != "switches"]
        assert len(tests) == 1, api.name
        assert tests[0].params_at("default")["steps"] == LONG_RUN_STEPS["default"]["steps"]
        assert tests[0].params_at("nightly")["steps"] == LONG_RUN_STEPS["nightly"]["steps"]
        assert tests[0].params_at("nightly", main_world_size=False)["steps"] == LONG_RUN_STEPS["default"]["steps"]


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
    fsdp = dataclasses.replace(make_spec("lossy3", any_strategy_hook),
                               lossy=LossyContract(rel_error_bound=0.5, loss_margin=0.5, deterministic=True))
    for api, spec in (("ddp", lossy), ("fsdp2", comm), ("fsdp", fsdp)):
        for test in (t for t in HOOK_APIS[api].plans if "lossy_loss" in t or "lossy_determinism" in t):
            got = [c for c in planned_cases(test, [spec], one_gpu) if c.variant != "hsdp"]
            assert got and {c.world_size for c in got if "hsdp" not in str(c.variant)} == {2}, (api, test, got)
    cpu = plan_settings(2, 3)
    got = planned_cases("test_ddp_lossy_loss", [lossy], cpu)
    assert got and {c.world_size for c in got} == {2}
    # The subgroup cases need 4 ranks: on the one-GPU machine they run on a CPU pool, not skipped for GPUs.
    subgroup = planned_cases("test_subgroup_parity", [make_spec("s", any_strategy_hook)], one_gpu)
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
    # batched_grad_copy changes DDP's own averaging, not the bucket a hook is handed: its cases are parity's
    assert {c.variant for c in got["test_ddp_future_contract"]} == set(DDP_CONFIGS) - {"subgroup", "batched_grad_copy"}
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
    # parity holds at one rank too; the batched_grad_copy cases are skipped for a spec meant for the default native
    assert not any(c.skip for c in got["test_ddp_parity"] if c.variant != "batched_grad_copy")
    assert all("native_modes=" in c.skip for c in got["test_ddp_parity"] if c.variant == "batched_grad_copy")


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
    assert [c for c in nccl if c.variant == "divide_factor"]
    assert not any(c.skip for c in nccl if c.world_size == 2 and c.variant != "sum_no_divide")
    # FSDP2's sum_no_divide native: skipped for a spec that does not name it, saying how to
    assert all("native_modes=('default', 'sum_no_divide')" in c.skip for c in nccl if c.variant == "sum_no_divide")
    # A one-GPU machine: its NCCL rank is alone, its world size 2 runs gloo on the CPU, so PREMUL_SUM skips there.
    one_gpu = planned_cases("test_fsdp2_parity", [_comm("c")], plan_settings(1, 3, backend="nccl", device="cuda",
                                                                             gpu_count=1, cpu_pools=(2, 3)))
    assert all(c.skip == GLOO_PREMUL_SUM for c in one_gpu if c.world_size == 2 and c.variant == "divide_factor")
    assert [c for c in one_gpu if c.world_size == 2 and c.variant == "divide_factor"]
    # fp16 reduces with SUM, never PREMUL_SUM: it runs on gloo.
    low = planned_cases("test_fsdp2_parity", [_comm("c16", torch.float16)], _settings([2, 3]))
    assert not any(c.skip for c in low if c.world_size in (2, 3) and c.variant != "sum_no_divide")
