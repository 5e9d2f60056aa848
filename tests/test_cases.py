"""Tests for conformance.cases: case ids, parsing them back, and which cases a spec gets.

Counts are worked out from what each spec serves (its strategies) and the world
sizes asked for, not from the implementation's loops.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.cases import (
    CONSISTENCY_MODELS,
    EXTRA_PARITY_MODELS,
    PARITY_MODELS,
    CaseParams,
    case_id,
    parse_case_id,
    registration_cases,
    training_cases,
)
from conformance.checks.fsdp import REGISTRATION_RULES
from conformance.spec import FSDP_STRATEGIES, HookSpec


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
    ids = [c.id for c in training_cases(SPECS, [2, 3], models={2: PARITY_MODELS, 3: EXTRA_PARITY_MODELS})]
    for spec in SPECS:
        mine = [i for i in ids if i.startswith(spec.name + "-")]
        assert mine and all(parse_case_id(i)["hook"] == spec.name for i in mine)
    # "ns_only-" cannot select another hook whose name merely starts with "ns_only".
    longer = make_spec("ns_only_v2", _no_shard)
    assert not any(c.id.startswith("ns_only-") for c in training_cases([longer], [2]))


def test_case_params_id_is_case_id():
    c = CaseParams("h", "FULL_SHARD", 3, model="net_flat")
    assert c.id == case_id("h", "FULL_SHARD", model="net_flat", world_size=3)
    r = CaseParams("h", "NO_SHARD", 2, rule="non_root_raises")
    assert r.id == "h-NO_SHARD-non_root_raises"


def test_describe_reports_only_what_the_case_has():
    assert CaseParams("h", "NO_SHARD", 2).describe("averaging") == {"check": "averaging", "api": "fsdp",
                                                                      "strategy": "NO_SHARD"}
    assert CaseParams("h", "NO_SHARD", 2, model="m").describe("parity")["model"] == "m"
    assert "model" not in CaseParams("h", "NO_SHARD", 2, rule="r").describe("registration")


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


@pytest.mark.parametrize("world_sizes", [[2], [2, 3], [4, 3, 1]])
def test_training_cases_are_every_served_strategy_at_every_world_size(world_sizes):
    got = training_cases(SPECS, world_sizes)
    served = sum(len(spec.strategies) for spec in SPECS)  # 1 + 2 + 3
    assert served == 6
    assert len(got) == served * len(world_sizes)
    assert len({c.id for c in got}) == len(got)
    for spec in SPECS:
        mine = {(c.variant, c.world_size) for c in got if c.hook == spec.name}
        assert mine == set(itertools.product(spec.strategies, world_sizes))
    assert all(c.model is None and c.rule is None for c in got)


def test_training_cases_with_models_per_world_size():
    models = {2: PARITY_MODELS, 3: EXTRA_PARITY_MODELS}
    got = training_cases([EVERYWHERE, NO_SHARD_ONLY], [2, 3], models=models)
    assert len(got) == (3 + 1) * (len(PARITY_MODELS) + len(EXTRA_PARITY_MODELS))
    at3 = {c.model for c in got if c.world_size == 3}
    assert at3 == set(EXTRA_PARITY_MODELS)


def test_world_size_without_models_gets_no_cases():
    got = training_cases([EVERYWHERE], [2, 3], models={2: ("net_flat",)})
    assert {c.world_size for c in got} == {2}


def test_strategy_filter_keeps_specs_that_serve_it():
    got = training_cases(SPECS, [2], models={2: CONSISTENCY_MODELS}, strategies=("NO_SHARD",))
    assert {c.hook for c in got} == {NO_SHARD_ONLY.name, EVERYWHERE.name}
    assert {c.variant for c in got} == {"NO_SHARD"}
    assert len(got) == 2 * len(CONSISTENCY_MODELS)


def test_no_specs_no_cases():
    assert training_cases([], [2, 3]) == []
    assert registration_cases([], 2, REGISTRATION_RULES) == []


def test_registration_cases_put_the_hybrid_rule_once_per_hook():
    got = registration_cases(SPECS, 2, REGISTRATION_RULES)
    other_rules = [r for r in REGISTRATION_RULES if r != "hybrid_strategy_raises"]
    assert "hybrid_strategy_raises" in REGISTRATION_RULES
    for spec in SPECS:
        mine = [c for c in got if c.hook == spec.name]
        hybrid = [c for c in mine if c.rule == "hybrid_strategy_raises"]
        assert len(hybrid) == 1 and hybrid[0].variant == "HYBRID"
        rest = {(c.rule, c.variant) for c in mine if c.rule != "hybrid_strategy_raises"}
        assert rest == set(itertools.product(other_rules, spec.strategies))
    assert len(got) == sum(1 + len(other_rules) * len(s.strategies) for s in SPECS)
    assert all(c.world_size == 2 for c in got)
    assert len({c.id for c in got}) == len(got)


def test_every_api_names_its_variant_and_carries_the_same_properties():
    fsdp = CaseParams("h", "FULL_SHARD", 3, model="net_flat")
    ddp = CaseParams("h", "small_buckets", 2, model="nested_wrapped", api="ddp")
    fsdp2 = CaseParams("h", "hsdp", 4, model="nested_wrapped", api="fsdp2")
    assert (fsdp.variant_field, ddp.variant_field, fsdp2.variant_field) == ("strategy", "config", "config")
    assert dict(ddp.junit_properties("parity")) == {
        "hook": "h", "api": "ddp", "check": "parity", "variant": "small_buckets", "config": "small_buckets",
        "world_size": 2, "model": "nested_wrapped"}
    for case in (fsdp, ddp, fsdp2):
        props = dict(case.junit_properties("parity"))
        assert {"hook", "api", "check", "variant", case.variant_field, "world_size"} <= set(props)
        assert case.describe("parity")[case.variant_field] == case.variant
    assert fsdp2.id == "h-hsdp-nested_wrapped-ws4"
