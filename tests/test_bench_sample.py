"""Tests for benchmarks/case_sample.py: the stratified sample of default-run cases that `make bench` times.

Only the sampling is tested here; the benchmark's timings are figures to report, never asserted.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "case_sample.py")
_spec = importlib.util.spec_from_file_location("case_sample", _PATH)
case_sample = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case_sample)

# Strata shaped like the default CPU run's passing cases: (api, world size) -> count.
DEFAULT_LIKE = {("ddp", 2): 61, ("ddp", 3): 36, ("ddp", 4): 2, ("fsdp", 2): 83, ("fsdp", 3): 15,
                ("fsdp", 4): 3, ("fsdp2", 2): 18, ("fsdp2", 3): 9, ("fsdp2", 4): 6}


def _population(sizes):
    return [(api, ws, i) for (api, ws), n in sorted(sizes.items()) for i in range(n)]


def _stratum(case):
    return case[:2]


def test_every_stratum_is_sampled_and_the_sample_has_the_size_asked():
    sample = case_sample.stratified_sample(_population(DEFAULT_LIKE), _stratum, 20, seed=10)
    assert len(sample) == 20
    assert set(map(_stratum, sample)) == set(DEFAULT_LIKE)


def test_the_rest_is_shared_in_proportion_to_stratum_size():
    # 9 strata take one case each; the other 11 go by size, 11 * n / 233: ddp ws2 (61 cases) 2.88,
    # fsdp ws2 (83) 3.92, ddp ws3 (36) 1.70, fsdp2 ws2 (18) 0.85, fsdp ws3 (15) 0.71, fsdp2 ws3 (9) 0.43.
    # The whole parts give 2 + 3 + 1; the five largest remainders (.92 .88 .85 .71 .70) get one more each.
    counts = case_sample.allocate(DEFAULT_LIKE, 20)
    assert counts == {("ddp", 2): 4, ("ddp", 3): 3, ("ddp", 4): 1, ("fsdp", 2): 5, ("fsdp", 3): 2,
                      ("fsdp", 4): 1, ("fsdp2", 2): 2, ("fsdp2", 3): 1, ("fsdp2", 4): 1}


def test_a_full_stratum_passes_its_share_on():
    assert case_sample.allocate({"a": 1, "b": 1, "c": 30}, 10) == {"a": 1, "b": 1, "c": 8}
    assert case_sample.allocate({"a": 2, "b": 3}, 50) == {"a": 2, "b": 3}


def test_the_same_seed_draws_the_same_sample_and_keeps_the_run_order():
    population = _population(DEFAULT_LIKE)
    first = case_sample.stratified_sample(population, _stratum, 20, seed=10)
    assert first == case_sample.stratified_sample(list(population), _stratum, 20, seed=10)
    assert first == sorted(first, key=population.index)
    others = {tuple(case_sample.stratified_sample(population, _stratum, 20, seed=s)) for s in range(5)}
    assert len(others) > 1  # the seed, not the population's order alone, picks the cases


def test_a_sample_smaller_than_the_strata_is_refused():
    with pytest.raises(ValueError, match="cannot cover 9 strata"):
        case_sample.allocate(DEFAULT_LIKE, 5)
    assert Counter(map(_stratum, case_sample.stratified_sample(_population(DEFAULT_LIKE), _stratum, 9, 0))) == \
        Counter({k: 1 for k in DEFAULT_LIKE})
