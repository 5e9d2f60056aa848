"""Tests for conformance.cases: case ids, parsing them back, what a case carries, and the suite test that makes
and runs it.

Which cases each API's plan makes for a spec is in ``tests/test_cases_plans.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.apis.fsdp.plan import REGISTRATION_RULES
from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.cases import CaseParams, case_id, parse_case_id
from conformance.signatures import FSDP_STRATEGIES
from tests.case_helpers import SPECS, make_spec, no_shard_hook
from tests.meta_helpers import plan_settings

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
    longer = make_spec("ns_only_v2", no_shard_hook)
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


# -- what a case carries, and the suite test that runs it ---------------------------------------


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


def test_every_kind_of_case_has_its_runner_and_a_suite_test_says_which():
    from conformance.apis import SuiteTest
    from conformance.catalogue import CASE_KINDS
    from conformance.controller.case_kinds import CaseKinds

    assert all(callable(getattr(CaseKinds, kind, None)) for kind in CASE_KINDS)
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


class _Session:
    """Stands for the Runner: what a case's plan reads of it (its settings)."""

    def __init__(self, depth="default"):
        self.settings = plan_settings(2, None, depth=depth)


def _planned(session, case):
    """What the runner would run for ``case``: its plan, as the fields a test compares."""
    from conformance.controller.case_kinds import CaseKinds

    plan = CaseKinds(session, object()).plan(case)
    assert plan.kind == HOOK_APIS[case.api].suite_test(case.check).kind
    return plan.check, plan.rank_check, plan.params, plan.across_ranks, plan.note is not None, plan.exact


@pytest.mark.parametrize("api, check, variant, model, expected", [
    ("fsdp", "subgroup_parity", "FULL_SHARD", "nested_wrapped",
     ("subgroup_parity", "fsdp.parity", {"strategy": "FULL_SHARD", "model": "nested_wrapped", "subgroup": True},
      False, False, False)),
    ("fsdp", "parity", "NO_SHARD", "net_flat",  # exact: a failure may end with the lossy-contract hint
     ("parity", "fsdp.parity", {"strategy": "NO_SHARD", "model": "net_flat"}, False, False, True)),
    ("ddp", "rank_consistency", "default", "net_flat",
     ("rank_consistency", "ddp.rank_grads", {"config": "default", "model": "net_flat", "steps": 4}, True, False,
      False)),
    ("fsdp2_all_reduce", "fsdp2_all_reduce_hook", "hsdp", "nested_wrapped",
     ("fsdp2_all_reduce_hook", "fsdp2_all_reduce.parity", {"config": "hsdp", "model": "nested_wrapped"}, False,
      False, False)),
    ("ddp", "lossy_error", "default", "transformer_shared",  # its figure becomes a property: a note
     ("lossy_error", "ddp.lossy_error", {"config": "default", "model": "transformer_shared"}, False, True, False)),
])
def test_a_suite_case_runs_its_suite_tests_rank_check_with_the_cases_parameters(api, check, variant, model, expected):
    assert _planned(_Session(), HOOK_APIS[api].suite_test(check).case("h", variant, 2, model=model)) == expected


@pytest.mark.parametrize("depth, world_size, steps", [("default", 2, 256), ("nightly", 2, 2000),
                                                      ("default", 3, 256), ("nightly", 3, 256)])
def test_a_long_run_trains_the_steps_of_its_depth_at_the_main_world_size_only(depth, world_size, steps):
    """The nightly's 2,000 steps at the main world size (2 here); a long run at another world size trains the
    default run's 256 there too."""
    session = _Session(depth)
    assert session.settings.world_size == 2
    case = HOOK_APIS["ddp"].suite_test("long_run").case("h", "default", world_size, model="nested_wrapped")
    assert _planned(session, case) == ("long_run", "ddp.long_run", {"config": "default", "model": "nested_wrapped",
                                                                    "steps": steps}, False, False, True)
