"""A claimed parameter dtype (``HookSpec.param_dtype``, issue 30) in the plans: every case of a claiming spec
carries it in its id and properties, a spec that claims none is planned exactly as before, and the built-in hooks'
sample (``HookSpec.sample_checks``) keeps what it says. No rank starts."""

from __future__ import annotations

import dataclasses

import torch

from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.cases import case_id, parse_case_id
from conformance.spec import HookSpec
from tests.meta_helpers import plan_settings


def _all(state, grad, output=None):
    pass


EVERYWHERE = HookSpec(name="every.where", api="fsdp", hook=_all, state=lambda pg: pg)


def _settings(world_sizes):
    return plan_settings(world_sizes[0], world_sizes[1] if len(world_sizes) > 1 else None)



def test_param_dtype_shows_in_the_id_after_the_model():
    assert case_id("h", "FULL_SHARD", model="net_wrapped", world_size=2, param_dtype="bfloat16") == \
        "h-FULL_SHARD-net_wrapped-params_bfloat16-ws2"
    assert parse_case_id("h-FULL_SHARD-net_wrapped-params_bfloat16-ws2")["world_size"] == 2


def test_a_spec_that_claims_a_param_dtype_has_every_case_carry_it_and_one_that_claims_none_is_planned_as_before():
    claimed = dataclasses.replace(EVERYWHERE, name="claimed", param_dtype=torch.bfloat16)
    settings = _settings([2, 3])
    for name in HOOK_APIS["fsdp"].plans:
        plain = planned_cases(name, [EVERYWHERE], settings)
        cases = planned_cases(name, [claimed], settings)
        assert [c.param_dtype for c in plain] == [None] * len(plain)
        assert all(c.param_dtype == "bfloat16" and "-params_bfloat16" in c.id for c in cases)
        assert [c.id.replace("-params_bfloat16", "").replace("claimed", "every.where") for c in cases] == \
            [c.id for c in plain], name
        if cases:
            assert dict(cases[0].junit_properties())["param_dtype"] == "bfloat16"
            assert cases[0].describe()["params"] == "bfloat16"


def test_sample_checks_keep_the_first_variant_and_model_at_the_main_world_size_of_those_checks():
    sampled = dataclasses.replace(EVERYWHERE, name="sampled", sample_checks=("parity", "accumulation"))
    settings = _settings([2, 3])
    kept = {name: planned_cases(name, [sampled, EVERYWHERE], settings) for name in HOOK_APIS["fsdp"].plans}
    mine = {name: [c for c in cases if c.hook == "sampled"] for name, cases in kept.items()}
    assert {name for name, cases in mine.items() if cases} == {"test_parity", "test_accumulation"}
    for cases in mine.values():
        assert len(cases) <= 1 and all(c.world_size == 2 and c.nodes == 1 for c in cases)
    assert mine["test_parity"][0].id == "sampled-NO_SHARD-net_wrapped-ws2"
    one_gpu = plan_settings(1, 2, backend="nccl", device="cuda", gpu_count=1, cpu_pools=(2, 3))
    assert [c.world_size for c in planned_cases("test_parity", [sampled], one_gpu)] == [2], "not at 1 rank"
    full = planned_cases("test_parity", [EVERYWHERE], settings)
    assert [c for c in kept["test_parity"] if c.hook == "every.where"] == full, "the other specs' cases are kept"


def test_a_sampled_check_planned_on_a_simulated_layout_alone_keeps_its_first_case_there():
    # The replica all-reduce is planned at 4 ranks as 2 nodes (and 2 as 2 nodes of 1) only: its sample is the
    # first of those, not nothing.
    from conformance.apis.fsdp2_replica.builtin_hooks import replica_avg_all_reduce, replica_group_state

    replica = HookSpec(name="replica.sampled", api="fsdp2_replica", hook=replica_avg_all_reduce,
                       state=replica_group_state, param_dtype=torch.bfloat16, sample_checks=("fsdp2_replica_parity",))
    settings = _settings([2, 3])
    from conformance.apis.fsdp2_replica.builtin_hooks import REPLICA_HOOKS

    full = planned_cases("test_fsdp2_replica_parity", [REPLICA_HOOKS[0]], settings)
    assert full and all(c.nodes > 1 for c in full)
    kept = planned_cases("test_fsdp2_replica_parity", [replica], settings)
    assert [c.id.replace("replica.sampled", "replica_avg_all_reduce").replace("-params_bfloat16", "")
            for c in kept] == [full[0].id]
    assert planned_cases("test_fsdp2_replica_accumulation", [replica], settings) == []
