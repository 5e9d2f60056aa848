"""Meta-tests specific to the all-gather comm API (``api="fsdp2_all_gather"``, ``set_custom_all_gather``).

They read the zoo's run (``tests/meta_zoos/``: ``FSDP2_ALL_GATHER``, one run per session); the shape every
zoo shares (each good comm passes every config, each bad one is caught where ``EXPECTED_CATCH`` says, with its
cause and fix) is in ``tests/test_meta.py``. Plus quick checks, without a pool, of the cause catalogue the
recorder names a wrong gather with.
"""

from __future__ import annotations

import pytest
import torch

from conformance.apis.fsdp2_all_gather import arithmetic, models
from conformance.apis.fsdp2_all_gather import plan as gather_plan
from conformance.signatures import SpecError
from conformance.spec import HookSpec
from tests.meta_helpers import select
from tests.meta_zoos import FSDP2_ALL_GATHER
from tests.zoo import fsdp2_all_gathers as zoo


@pytest.fixture
def run(zoo_runs):
    return zoo_runs(FSDP2_ALL_GATHER)


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
    assert "reverse rank order" in arithmetic.explain(_call(torch.cat([shards[2:], shards[:2]]), shards)).words
    assert "bfloat16 on the wire" in arithmetic.explain(_call(shards.bfloat16().float(), shards)).words
    old = shards * 2
    assert "stale" in arithmetic.explain(_call(old.clone(), shards, previous=old)).words
    assert "group of 4 ranks" in arithmetic.explain(_call(shards + 1, shards, other_groups=(4,))).words
    signed = torch.tensor([0.0, -0.0, float("nan"), 1.0])
    assert "a zero's sign changed" in arithmetic.explain(_call(signed + 0.0, signed)).words
    assert arithmetic.explain(_call(shards + 1, shards)) is None
    # Each cause by its code, as CAUSES lists them: never by its words.
    assert arithmetic.explain(_call(old.clone(), shards, previous=old)).code == "stale"
    wire = arithmetic.explain(_call(shards.bfloat16().float(), shards))
    assert wire.family == "wire_dtype(dtype=bfloat16, own=float32)"
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
        SETUP.bound(lambda: object(), None, "h", None)


def test_offsets_padding_and_tails_are_named_bit_for_bit():
    n = 21
    shards = torch.arange(1, 2 * n + 1, dtype=torch.float32) / 7
    wire = torch.zeros(64)  # each shard padded to 32 elements on the wire, the padding kept
    wire[:n], wire[32:32 + n] = shards[:n], shards[n:]
    found = arithmetic.explain(_call(wire[:2 * n].clone(), shards))
    cause, fix = found.words, found.fix
    assert found.code == "shard_offsets" and found.params == (("stride", 32), ("shard_size", n))
    assert "shard r of the group at element r * 32, not r * 21 (padding of 11 elements kept" in cause
    assert fix == arithmetic.OFFSET_FIX
    tail = shards.clone()
    tail[n - 5:n] = tail[2 * n - 5:] = 0.0  # a chunk loop that stops 5 elements short of each shard's end
    assert "elements 16 to 20 of each shard's chunk (of 21) are not the shard's" in arithmetic.explain(
        _call(tail, shards)).words


def test_chunks_indexed_by_the_global_rank_are_named_where_the_group_is_not_0_to_n():
    shards = torch.arange(1, 9, dtype=torch.float32) / 3
    both_in_chunk_0 = torch.cat([shards[4:], torch.full((4,), 9.0)])  # {0,2}: 0 % 2 == 2 % 2, the last one kept
    assert "indexed by the global rank modulo the group size" in arithmetic.explain(
        _call(both_in_chunk_0, shards, ranks=(0, 2))).words
    assert arithmetic.explain(_call(both_in_chunk_0, shards, ranks=(0, 1))) is None  # there it is the group rank


def test_hard_shard_spreads_hard_values_between_distinct_ones():
    got = models.hard_shard(3 * len(models.HARD_BITS), torch.float32, 0, spread=3)
    assert [b & 0xFFFFFFFF for b in arithmetic.bits(got[::3]).tolist()] == list(models.HARD_BITS)
    ordinary = torch.cat([got[1::3], got[2::3]])
    assert len(set(ordinary.tolist())) == ordinary.numel()  # distinct: a shard at another offset differs
