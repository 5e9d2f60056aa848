"""conformance.controller.hard_examples and hard_inputs: what the hard-input cases feed the ranks.

The named examples are deterministic, so their properties are checked directly;
the drawn ones as a case draws them (``drawn_examples``, seeded), and per example
through hypothesis's ``@given``.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conformance.controller.hard_examples import (RANK_MAGNITUDES, hard_gradients, named_hard_values,
                                                  rank_magnitude_values, special_values)
from conformance.controller.hard_inputs import claim_examples, drawn_examples, examples_seed, probe_layout

SHAPES, NAMES = probe_layout()


def _largest(rank_grads) -> float:
    return max(float(g.abs().nan_to_num(nan=0.0).max()) for g in rank_grads)


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_each_rank_of_the_magnitudes_example_has_its_own_size(world_size):
    grads = rank_magnitude_values(world_size, SHAPES)
    assert len(grads) == world_size and [g.shape for g in grads[0]] == [torch.Size(s) for s in SHAPES]
    largest = [_largest(rank) for rank in grads]
    # Rank 1's gradients are about 10**6 times smaller than rank 0's, wholly below float16's normal range.
    assert largest[1] < torch.finfo(torch.float16).smallest_normal < 1e-2 < largest[0]
    assert largest[0] / largest[1] > 1e5
    for r, rank in enumerate(grads):
        for g in rank:
            assert g.dtype == torch.float32 and bool(torch.isfinite(g).all()) and bool((g != 0).all())
            # Every rank's values fit float16 and bfloat16 without overflow: a size, not an overflow test.
            assert float(g.abs().max()) < torch.finfo(torch.float16).max
        if r >= 2:
            ratio = largest[r] / largest[0]
            assert math.isclose(ratio, RANK_MAGNITUDES[r % len(RANK_MAGNITUDES)], rel_tol=0.5)


def test_the_packed_named_example_puts_overflow_sized_values_on_every_rank():
    """Why the magnitudes example is not packed: every rank's buckets there hold values near the overflow."""
    big = special_values(torch.float16)["near_overflow"][0]
    for rank in named_hard_values(3, SHAPES, torch.float16):
        assert _largest(rank) >= big


def _ordinary_size(rank) -> float:
    """The median size of a rank's ordinary values (not zero, not a hard value)."""
    ordinary = torch.cat([g.flatten() for g in rank]).abs()
    ordinary = ordinary[(ordinary > 1e-30) & (ordinary < 1e4) & torch.isfinite(ordinary)]
    return float(ordinary.median()) if ordinary.numel() >= 10 else float("nan")


def test_drawn_examples_put_ranks_orders_of_magnitude_apart():
    """Of the examples a case draws, a third or more put two ranks' ordinary values 100 times or more apart
    (each rank draws one of four magnitudes: 3 in 4 pairs of ranks differ)."""
    apart = 0
    drawn = drawn_examples(hard_gradients(2, SHAPES, NAMES, None), 20, seed=1)
    for example in drawn:
        sizes = [_ordinary_size(rank) for rank in example.grads()]
        apart += max(sizes) / min(sizes) > 1e2
    assert apart >= len(drawn) // 3, (apart, len(drawn))


def _bits(drawn) -> list:
    return [[g.view(torch.int32).tolist() for g in rank] for example in drawn for rank in example.grads()]


def test_a_seed_draws_the_same_examples_whatever_modules_the_process_loaded(tmp_path, monkeypatch):
    """Hypothesis mixes literals from the source of loaded local modules into its draws; the suite's draws
    (:func:`drawn_examples`, a failure's search) leave them out, so a module full of float literals loaded
    between two draws from one seed (as a run's first failure loads the diagnosis, or a hook's module loads)
    changes nothing, and a re-run in a process that loaded less sends the same examples."""
    strategy = hard_gradients(2, SHAPES, NAMES, None)
    before = _bits(drawn_examples(strategy, 20, seed=3))
    folder = tmp_path / "hook_package"
    folder.mkdir()
    literals = ", ".join(repr(1.25 * 10.0 ** -k) for k in range(300))
    (folder / "many_literals.py").write_text(f"VALUES = [{literals}]\n")
    monkeypatch.syspath_prepend(str(folder))
    try:
        importlib.import_module("many_literals")
        assert _bits(drawn_examples(strategy, 20, seed=3)) == before
    finally:
        sys.modules.pop("many_literals", None)


def test_a_claims_examples_are_the_seeded_draw_drawn_once():
    """Every case at one world size and reduce dtype sends the same examples: those hypothesis draws with
    :func:`examples_seed`, which a failing case's search (seeded the same) draws again before it shrinks."""
    first = claim_examples(3, torch.bfloat16, 4, "")
    assert claim_examples(3, torch.bfloat16, 4, "") is first  # drawn once per run
    again = drawn_examples(hard_gradients(3, SHAPES, NAMES, torch.bfloat16), 4, examples_seed(3, torch.bfloat16))
    assert len(first) == 4 and _bits(first) == _bits(again)
    assert [g.data_ptr() for g in first[0].grads()[0]] != [g.data_ptr() for g in first[0].grads()[0]]  # fresh
    for other in (claim_examples(3, torch.bfloat16, 4, "7"), claim_examples(2, torch.bfloat16, 4, ""),
                  claim_examples(3, None, 4, "")):
        assert _bits(other)[:2] != _bits(first)[:2]


def test_no_drawn_example_is_the_simplest_one():
    """Hypothesis starts from every element +0.0: a case's examples are drawn after it, every one with values."""
    for world_size, seed in [(2, ""), (3, "1"), (4, "2")]:
        drawn = claim_examples(world_size, None, 3, seed)
        assert len(drawn) == 3
        for example in drawn:
            assert sum(bool((g != 0).sum()) for rank in example.grads() for g in rank) > world_size


@settings(max_examples=10, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=hard_gradients(3, SHAPES, NAMES, torch.bfloat16))
def test_drawn_values_are_float32_values(drawn):
    """A drawn value is exactly the float32 the rank trains on: the repr a shrunk failure prints is the input."""
    for rank_values, rank_grads in zip(drawn.values, drawn.grads()):
        for values, g in zip(rank_values, rank_grads):
            for v, t in zip(values, g.flatten().tolist()):
                assert (math.isnan(v) and math.isnan(t)) or v == t
