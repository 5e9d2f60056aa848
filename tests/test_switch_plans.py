"""The combined cases (issue 44): where a hook's switches hold at once, planned by every API from its long run.

A spec that names its switches (``HookSpec(switches=Switches(...))``) gets one combined case per API at every
depth, sized by them; at nightly depth every exact spec gets the nightly's own combination. Counts and sizes are
worked out from the switches and the world sizes, not from the plan's loops.
"""

from __future__ import annotations

import pytest
import torch

from conformance.apis import is_reach_case
from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.apis.switches import COMBINED_MODEL, COMBINED_NODES, COMBINED_STEPS
from conformance.cases import parse_case_id
from conformance.models import SWITCH_PROBES
from conformance.spec import HookSpec, LossyContract, Switches
from conformance.signatures import SpecError
from tests.meta_helpers import plan_settings
from tests.test_claim_plans import HOOKS


def _spec(api, switches=None, **kwargs):
    hook, state = HOOKS[api]
    return HookSpec(name="s", api=api, hook=hook, state=state, switches=switches, **kwargs)


def _combined(spec, depth="default"):
    settings = plan_settings(2, 3, depth=depth)
    return [c for test in HOOK_APIS[spec.api].plans.values() if test.kind == "switches"
            for name, t in HOOK_APIS[spec.api].plans.items() if t is test
            for c in planned_cases(name, [spec], settings)]


@pytest.mark.parametrize("api", sorted(HOOKS))
def test_a_hook_that_names_no_switch_gets_no_combined_case_at_the_default_depth(api):
    assert _combined(_spec(api)) == []


@pytest.mark.parametrize("api", sorted(HOOKS))
def test_at_nightly_depth_every_exact_hook_gets_the_nightly_combination(api):
    (case,) = _combined(_spec(api), "nightly")
    assert (case.model, case.steps, case.nodes) == (COMBINED_MODEL, COMBINED_STEPS, COMBINED_NODES)
    assert COMBINED_STEPS >= 300 and SWITCH_PROBES[COMBINED_MODEL].numel > 2**20
    assert case.world_size % case.nodes == 0 and case.skip is None
    assert is_reach_case(case) and case.id.endswith(f"-{COMBINED_STEPS}steps-2nodes-ws{case.world_size}")
    assert parse_case_id(case.id)["steps"] == COMBINED_STEPS


@pytest.mark.parametrize("api", sorted(HOOKS))
def test_named_switches_are_reached_together_at_every_depth(api):
    spec = _spec(api, Switches(steps=64, elements=2**19, nodes=2))
    for depth in ("default", "nightly"):
        (case,) = _combined(spec, depth)
        assert case.steps == 64 + 16 and case.nodes == 2 and case.world_size % 2 == 0
        # a hook handed a shard of the parameter (a replica hook on s shards) still sees the switch's size
        assert SWITCH_PROBES[case.model].numel >= 2**19 * case.world_size
        assert SWITCH_PROBES[case.model].numel < 4 * 2**19 * case.world_size  # the smallest that reaches it
        assert case.skip is None


def test_a_step_switch_trains_a_quarter_past_it_and_bytes_count_in_the_claimed_dtype():
    (case,) = _combined(_spec("fsdp2", Switches(steps=1000)))
    assert case.steps == 1250 and case.nodes == 1
    (bf16,) = _combined(_spec("fsdp2", Switches(bytes=2**21), reduce_dtype=torch.bfloat16))
    (fp32,) = _combined(_spec("fsdp2", Switches(bytes=2**21)))
    assert SWITCH_PROBES[bf16.model].numel >= 2**20 * bf16.world_size > SWITCH_PROBES[fp32.model].numel // 2


def test_a_switch_past_the_largest_model_is_skipped_with_its_reason():
    (case,) = _combined(_spec("ddp", Switches(elements=2**30)))
    assert case.skip and "is past the largest model the suite trains" in case.skip


def test_a_lossy_contract_gets_no_combined_case():
    spec = HookSpec(name="s", api="ddp", hook=HOOKS["ddp"][0], state=HOOKS["ddp"][1], lossy=LossyContract(0.1),
                    switches=Switches(steps=10))
    assert _combined(spec) == [] and _combined(spec, "nightly") == []


@pytest.mark.parametrize("kwargs, needle", [({}, "names no switch"), ({"steps": 0}, "steps=0"),
                                            ({"nodes": 1}, "nodes=1"), ({"elements": 2.5}, "elements=2.5"),
                                            ({"bytes": True}, "bytes=True")])
def test_switches_refuse_what_names_no_switch(kwargs, needle):
    with pytest.raises(SpecError, match=needle):
        Switches(**kwargs)


def test_a_spec_refuses_switches_that_are_not_switches():
    with pytest.raises(SpecError, match="must be a Switches"):
        _spec("ddp", {"steps": 10})
