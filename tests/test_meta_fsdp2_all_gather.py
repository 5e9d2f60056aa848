"""Meta-tests of the all-gather comm API (``api="fsdp2_all_gather"``, ``FSDPModule.set_custom_all_gather``).

The zoo run (``tests/zoo/fsdp2_all_gathers.py``, one run per session: every case of the API but the
registration rules, at the main world size and on the 4-rank pool) must pass every good comm and catch
every bad one where ``EXPECTED_CATCH`` says, with its cause named. Plus quick checks, without a pool, of the
cause catalogue the recorder names a wrong gather with.
"""

from __future__ import annotations

import pytest
import torch

from conformance.apis.fsdp2_all_gather import arithmetic, models
from conformance.apis.fsdp2_all_gather import plan as gather_plan
from conformance.signatures import SpecError
from conformance.spec import HookSpec
from tests.meta_helpers import MetaZoo, select
from tests.zoo import fsdp2_all_gathers as zoo

ALL_GATHER = MetaZoo(
    name="fsdp2_all_gathers",
    args=("--hook", "tests.zoo.fsdp2_all_gathers:ALL", "--extra-world-size", "4", "-q",
          "-k", "fsdp2_all_gather and not registration"),
    bad=frozenset(s.name for s in zoo.KNOWN_BAD), documented=frozenset(zoo.EXPECTED_CATCH), catches=(),
    good=tuple(zoo.KNOWN_GOOD))

EVERY_CONFIG = {"default", "no_reshard", "hsdp", "subgroup"}
#: bad comm -> (the check, the configs whose cases must fail there, and only those; the text(s) each carries).
MUST_CATCH = {
    "bad_reversed_order": ("fsdp2_all_gather_parity", EVERY_CONFIG, "by the shards in reverse rank order"),
    "bad_cached_gather": ("fsdp2_all_gather_parity", EVERY_CONFIG, "the gather of step 0 (stale"),
    "bad_bf16_wire": ("fsdp2_all_gather_parity", EVERY_CONFIG, "the shards cast to bfloat16 on the wire"),
    "bad_default_group": ("fsdp2_all_gather_parity", {"hsdp", "subgroup"},
                          "over a group of 4 ranks where FSDP2 passed it a group of 2"),
    "bad_dropped_work": ("fsdp2_all_gather_parity", EVERY_CONFIG, "neither waited on its Work nor returned it"),
    "bad_bf16_alloc": ("fsdp2_all_gather_parity", EVERY_CONFIG,
                       ("dtype=float32) returned shape (", "bfloat16 on cpu")),
    "bad_scaled_by_one": ("fsdp2_all_gather_hard_params", {"default", "subgroup"},
                          ("bit for bit: first at element",
                           "explained, bit for bit, by the same values with other bits")),
}


@pytest.fixture
def run(zoo_runs):
    return zoo_runs(ALL_GATHER)


def test_every_bad_comm_has_an_expected_catch():
    assert set(MUST_CATCH) == ALL_GATHER.bad == ALL_GATHER.documented


@pytest.mark.parametrize("spec", zoo.KNOWN_GOOD, ids=lambda s: s.name)
def test_good_comm_passes_every_case(run, spec):
    cases = run.by_hook()[spec.name]
    assert {c.properties.get("config") for c in cases} == EVERY_CONFIG, [c.name for c in cases]
    bad = [f"{c.name}: {c.outcome}\n{c.message[:2000]}" for c in cases if c.outcome != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("hook", sorted(MUST_CATCH))
def test_bad_comm_is_caught_where_expected_with_its_cause(run, hook):
    check, configs, text = MUST_CATCH[hook]
    cases = run.by_hook()[hook]
    failed = [c for c in cases if c.outcome == "failed" and c.properties.get("check") == check]
    assert {c.properties.get("config") for c in failed} == configs, [(c.name, c.outcome) for c in cases]
    for case in failed:
        for needle in (text,) if isinstance(text, str) else text:
            assert needle in case.message, f"{case.name}:\n{case.message[:3000]}"
    assert not [c.name for c in cases if c.outcome == "error"]


def test_default_group_passes_on_the_pool_mesh(run):
    """On a 1-D mesh over the pool the group FSDP2 passes is the default group: the same comm is right there."""
    assert select(run, "bad_default_group", "passed", check="fsdp2_all_gather_parity", config="default")


def test_scaled_by_one_passes_parity(run):
    """x * 1.0 is exact on every value training produces: only hard parameter shards tell it."""
    cases = select(run, "bad_scaled_by_one", check="fsdp2_all_gather_parity")
    assert cases and all(c.outcome == "passed" for c in cases), [(c.name, c.outcome) for c in cases]


def test_cached_gather_differs_from_step_1_only(run):
    case = select(run, "bad_cached_gather", "failed", check="fsdp2_all_gather_parity", config="default")[0]
    assert ", step 1]" in case.message and ", step 0]" not in case.message, case.message[:2000]


# -- the building blocks, without a pool ---------------------------------------------------------


def _call(output, expected, **kw):
    return arithmetic.GatherCall(step=1, index=0, output=output, expected=expected, group_size=2, **kw)


def test_causes_are_named_bit_for_bit():
    shards = torch.tensor([1.0, 2.0, 3.0, 4.0]) / 3
    assert "reverse rank order" in arithmetic.explain(_call(torch.cat([shards[2:], shards[:2]]), shards))[0]
    assert "bfloat16 on the wire" in arithmetic.explain(_call(shards.bfloat16().float(), shards))[0]
    old = shards * 2
    assert "stale" in arithmetic.explain(_call(old.clone(), shards, previous=old))[0]
    assert "group of 4 ranks" in arithmetic.explain(_call(shards + 1, shards, other_groups=(4,)))[0]
    signed = torch.tensor([0.0, -0.0, float("nan"), 1.0])
    assert "a zero's sign changed" in arithmetic.explain(_call(signed + 0.0, signed))[0]
    assert arithmetic.explain(_call(shards + 1, shards)) is None
    assert "no known cause" in arithmetic.findings_text(_call(shards + 1, shards))[1]


def test_hard_shard_keeps_nan_payloads_and_signed_zeros():
    got = models.hard_shard(len(models.HARD_BITS), torch.float32, 0)
    assert [b & 0xFFFFFFFF for b in arithmetic.bits(got).tolist()] == list(models.HARD_BITS)
    assert not arithmetic.same_bits(got, models.hard_shard(len(models.HARD_BITS), torch.float32, 1))
    quieted = got * 1.0  # a signalling NaN comes back quiet: a changed bit the check must see
    assert not arithmetic.same_bits(got, quieted)


def test_a_reduce_dtype_or_lossy_claim_is_refused():
    with pytest.raises(SpecError, match="takes no reduce_dtype"):
        gather_plan.validate(HookSpec(name="x", api="fsdp2_all_gather", hook=zoo.ListCatAllGather,
                                      reduce_dtype=torch.bfloat16))


def test_a_factory_that_makes_no_comm_is_named_as_an_all_gather():
    from conformance.apis.fsdp2_all_gather.standalone import SETUP

    assert isinstance(SETUP.bind(zoo.ListCatAllGather, None, "h", None), zoo.ListCatAllGather)
    with pytest.raises(TypeError, match=r"not an AllGather comm .*__call__\(output_tensor, input_tensor, group, "
                                        r"async_op\)"):
        SETUP.bind(lambda: object(), None, "h", None)
