"""Meta-tests for lossy contracts on FSDP1 and FSDP2: a declared contract gets a verdict with figures.

They read one run of the conformance suite (``tests/meta_zoos/``: LOSSY, once per session) over the
lossy stories of both zoos (``LOSSY`` in ``tests/zoo/fsdp_hooks/`` and
``tests/zoo/fsdp2_comms/``), judged by its JUnit XML: hooks and comms that declare a
``LossyContract`` that holds pass with their observed figures; ones whose declared bound is
too tight fail with the figure; the same comms without a contract fail the exact checks,
with the hint to declare one only where no named exact cause explains the difference. The
run keeps parity to ``nested_wrapped`` (every config and world size of it) and leaves hard
inputs and clip_grad_norm_ out: the exact zoo runs cover those. Plus checks, without a pool,
of which cases a lossy spec is planned and of the hint. The shape every zoo shares (each bad spec
caught, each good one passing, the hint where no named cause explains) is in ``tests/test_meta.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.controller.attribution import (DECLARE_LOSSY_HINT, Blame, CaseFacts, Replay, Run, attribute,
                                                lossy_hint_fits)
from conformance.protocol import CaseResult, CheckResult, Finding, RankOutcome
from conformance.signatures import SpecError
from conformance.spec import HookSpec, LossyContract
from tests.meta_helpers import planned_test_names
from tests.meta_zoos import (LOSSY, LOSSY_EXCEEDS_BOUND, LOSSY_HINT, LOSSY_MORE_ACCURATE,
                             LOSSY_UNDECLARED_UNEXPLAINED)
from tests.zoo import fsdp2_comms as zoo2
from tests.zoo import fsdp_hooks as zoo1

LOSSY_GOOD = zoo1.LOSSY_GOOD + zoo2.LOSSY_GOOD
LOSSY_BAD = zoo1.LOSSY_BAD + zoo2.LOSSY_BAD


@pytest.fixture
def lossy_run(zoo_runs):
    return zoo_runs(LOSSY)


def _cases(run, hook, check=None):
    return [c for c in run.by_hook()[hook] if check is None or c.check == check]


def _spec(name):
    return next(s for s in LOSSY_GOOD + LOSSY_BAD if s.name == name)


# -- without a pool ------------------------------------------------------------------------------


def test_every_bad_lossy_spec_has_an_expected_catch():
    assert {s.name for s in zoo1.LOSSY_BAD} == set(zoo1.LOSSY_EXPECTED)
    assert {s.name for s in zoo2.LOSSY_BAD} == set(zoo2.LOSSY_EXPECTED)
    assert set(LOSSY_EXCEEDS_BOUND) | set(LOSSY_UNDECLARED_UNEXPLAINED) | set(LOSSY_MORE_ACCURATE) == \
        {s.name for s in LOSSY_BAD}


@pytest.mark.parametrize("spec", [s for s in zoo1.LOSSY + zoo2.LOSSY], ids=lambda s: s.name)
def test_a_contract_replaces_the_exact_checks(spec):
    """A spec with a contract is planned the contract's checks and the API's structural ones, never the
    exact ones; a spec without one, the reverse."""
    tests = {name.split("[", 1)[0] for name in planned_test_names([spec])}
    lossy = {t for t in tests if "lossy" in t}
    if spec.lossy is None:
        assert not lossy, sorted(tests)
    elif spec.api == "fsdp":  # rank consistency is a NO_SHARD check; the training loss, where a margin is declared
        assert tests == {"test_registration", "test_lossy_error", "test_lossy_determinism"} | (
            {"test_rank_consistency"} if "NO_SHARD" in (spec.strategies or ("NO_SHARD",)) else set()) | (
            {"test_lossy_loss"} if spec.lossy.loss_margin else set())
    else:  # FSDP2's registration rules, like FSDP1's, hold for any comm
        assert tests == {"test_fsdp2_registration", "test_fsdp2_lossy_error", "test_fsdp2_lossy_determinism"} | (
            {"test_fsdp2_lossy_loss"} if spec.lossy.loss_margin else set())


def test_an_all_reduce_hook_cannot_declare_a_contract():
    with pytest.raises(SpecError, match="api='fsdp2_all_reduce' takes no lossy contract.*api='fsdp2'"):
        HookSpec(name="lossy_all_reduce", api="fsdp2_all_reduce", hook=zoo2.unit_scale_hook,
                 lossy=LossyContract(rel_error_bound=1e-2))


def test_the_hint_is_offered_only_where_no_named_cause_explains():
    differs = Finding(0, "local gradient shard differs from native fully_shard", step=0)
    unknown = Finding(0, "no known cause explains the hook's result", step=0, kind="no_known_cause")
    named = Finding(0, "the hook's result is explained, bit for bit, by: SUM without averaging", step=0,
                    kind="diagnosis")
    local = Finding(0, "every rank still holds its own local gradient", step=0, kind="local_gradient")
    wider = Finding(0, "the hook's result is explained, bit for bit, by: reduced in float32, where the hook claims "
                       "bfloat16", step=0, kind="diagnosis_wider_dtype")
    leak = Finding(0, "the hook left torch's default dtype changed", kind="process_state")
    assert lossy_hint_fits([differs, unknown])
    assert not lossy_hint_fits([differs, unknown, named])
    assert lossy_hint_fits([differs, wider])  # more accurate than native
    assert not lossy_hint_fits([local])
    assert not lossy_hint_fits([leak])  # what it left behind is no design
    assert lossy_hint_fits([differs, leak])


def test_the_attribution_closes_an_exact_claims_unexplained_failure_with_the_hint():
    """The hint is the attribution's: on the hook's failure of a case that claims exactness (an exactness check,
    no lossy contract), never on a lossy contract's case or one a named cause explains."""
    ok = RankOutcome(rank=0, ok=True, value=CheckResult())
    found = (Finding(0, "gradient differs", step=0, fqn="w"),
             Finding(0, "no known cause explains the hook's result", step=0, kind="no_known_cause"))
    first = Run(Replay.NONE, CaseResult(case=None, world_size=1, outcomes=(ok,)), found)
    facts = CaseFacts(check="fsdp2.parity", hook="mine", claims_exactness=True)
    decided = attribute(facts, [first])
    assert decided.blame is Blame.HOOK and decided.reason == "  " + DECLARE_LOSSY_HINT
    assert attribute(dataclasses.replace(facts, claims_exactness=False), [first]).reason == ""
    named = dataclasses.replace(first, findings=found[:1] + (
        Finding(0, "explained, bit for bit, by: SUM without averaging", step=0, kind="diagnosis"),))
    assert DECLARE_LOSSY_HINT not in attribute(facts, [named]).reason


# -- the run -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [s.name for s in LOSSY_GOOD])
def test_a_contract_that_holds_passes_with_its_figures(lossy_run, name):
    spec = _spec(name)
    cases = _cases(lossy_run, name)
    bad = [f"{c.name}: {c.outcome}\n{c.message[:2000]}" for c in cases if c.outcome != "passed"]
    assert cases and not bad, "\n".join(bad)
    errors = [c for c in cases if c.check.endswith("lossy_error")]
    assert errors and {c.properties.get("world_size") for c in errors} >= {"2", "3"}
    for case in errors:
        figure = float(case.properties["observed_rel_error"])
        assert 0 < figure <= spec.lossy.rel_error_bound, case.name
    losses = [c for c in cases if c.check.endswith("lossy_loss")]
    assert losses and all(0 <= float(c.properties["observed_loss_rel_diff"]) <= spec.lossy.loss_margin
                          for c in losses)


@pytest.mark.parametrize("name", LOSSY_EXCEEDS_BOUND)
def test_a_bound_exceeded_is_caught_with_its_figure(lossy_run, name):
    bound = _spec(name).lossy.rel_error_bound
    cases = _cases(lossy_run, name)
    errors = [c for c in cases if c.check.endswith("lossy_error")]
    assert errors and all(c.outcome == "failed" for c in errors), [(c.name, c.outcome) for c in errors]
    for case in errors:
        figure = case.properties["observed_rel_error"]
        assert float(figure) > bound, case.name
        assert f"observed max relative error {figure}" in case.message, case.message[-1500:]
        assert f"exceeds the declared rel_error_bound {bound:.3e}" in case.message, case.message[-1500:]
    # Only the bound is broken: the structural checks and determinism pass.
    others = [c for c in cases if not c.check.endswith("lossy_error")]
    assert others and all(c.outcome == "passed" for c in others), [(c.name, c.outcome) for c in others]


def test_the_more_accurate_comm_without_a_contract_fails_parity_at_three_ranks(lossy_run):
    """Float32 accumulation rounded once equals native bfloat16 bit for bit at 2 ranks (both round the exact
    sum once) and differs at 3, by one bfloat16 ULP; the diagnosis names the float32 reduction (wider than
    the bfloat16 claim: more accurate than native), and the hint says how to declare it lossy. Declared
    (good_fp32_accumulate_bf16), the same comm passes."""
    cases = _cases(lossy_run, "bad_fp32_accumulate_bf16_undeclared", "fsdp2_parity")
    failed = {c.properties.get("world_size") for c in cases if c.outcome == "failed"}
    passed = {(c.properties.get("config"), c.properties.get("world_size")) for c in cases if c.outcome == "passed"}
    assert failed == {"3"} and ("default", "2") in passed, (failed, passed)
    for case in [c for c in cases if c.outcome == "failed"]:
        assert "max ULP diff 65536" in case.message, case.message[:2000]
        assert "reduced in float32, where the hook claims bfloat16" in case.message, case.message[-1500:]
        assert LOSSY_HINT in case.message, case.message[-1500:]


