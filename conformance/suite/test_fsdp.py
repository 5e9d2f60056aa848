"""Conformance of ``FullyShardedDataParallel.register_comm_hook`` hooks (``api="fsdp"``).

Every test here runs on the rank pool through the ``conform`` fixture and is
parametrized by the FSDP adapter's case plan (``conformance/apis/fsdp/adapter.py``):
the hooks under test, the sharding strategies each serves, reference models
and world sizes (``conformance/cases.py`` says how case ids read).
The behaviour comes from PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``.

A hook that claims exactness (``lossy=None``) gets averaging, parity, subgroup
parity, clip_grad_norm_ and hard inputs; a hook with a ``LossyContract`` gets the
lossy-contract checks instead (``test_lossy_*``). Every hook gets the
registration rules and rank consistency under ``NO_SHARD``.
"""

from __future__ import annotations

import pytest

from conformance.controller import lossy_cases
from conformance.controller.hard_inputs import check_case

pytestmark = pytest.mark.conformance(api="fsdp")


def test_averaging(conform, request, case):
    """Default averaging: Linear(1, world_size), input = rank; every gradient element is mean(0..ws-1), 4 steps."""
    lossy_cases.exact_case(conform, request, case, "averaging", "fsdp.averaging", {"strategy": case.variant})


def test_parity(conform, request, case):
    """Gradients and parameters bitwise equal to the native path (no hook, or MixedPrecision(reduce_dtype))."""
    lossy_cases.exact_case(conform, request, case, "parity", "fsdp.parity",
                           {"strategy": case.variant, "model": case.model})


def test_subgroup_parity(conform, request, case):
    """Parity with both models, and the hook's state, on a data-parallel subgroup of the pool, not WORLD:
    a hook that reduces over the default group instead of its state's process group mixes the groups."""
    conform.check(request, case, "subgroup_parity", "fsdp.parity",
                  {"strategy": case.variant, "model": case.model, "subgroup": True})


def test_clip_grad_norm(conform, request, case):
    """FullyShardedDataParallel.clip_grad_norm_ (norm types 2 and inf) with the hook registered: the total norm
    and the clipped gradients bitwise equal to the native path's (PyTorch's test_fsdp_clip_grad_norm.py)."""
    conform.check(request, case, "clip_grad_norm", "fsdp.clip_grad_norm",
                  {"strategy": case.variant, "model": case.model})


def test_clip_grad_norm_low_precision(conform, request, case):
    """clip_grad_norm_ as above with float16 gradients kept (MixedPrecision(param_dtype=float16,
    keep_low_precision_grads=True), PyTorch's test_low_precision_grads): the float16 total norm and clipped
    gradients bitwise equal to the native path reducing in the hook's reduce dtype (float16 when it claims none)."""
    conform.check(request, case, "clip_grad_norm_low_precision", "fsdp.clip_grad_norm",
                  {"strategy": case.variant, "model": case.model, "low_precision_grads": True})


def test_rank_consistency(conform, request, case):
    """Under NO_SHARD every rank holds the identical gradient after each step."""
    conform.check(request, case, "rank_consistency", "fsdp.rank_grads",
                  {"strategy": case.variant, "model": case.model}, across_ranks=True)


def test_registration(conform, request, case):
    """register_comm_hook's contract (PyTorch's test_fsdp_comm_hooks.py) with the hook under test."""
    strategy = "FULL_SHARD" if case.variant == "HYBRID" else case.variant
    conform.check(request, case, "registration", "fsdp.registration", {"strategy": strategy, "rule": case.rule})


def test_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients reduce bit for bit like the native path.

    The named examples first, then ``--hypothesis-examples`` generated ones,
    shrunk to a minimal example on failure (``conformance.controller.hard_inputs.check_case``).
    """
    check_case(conform, request, case, "hard_inputs", "fsdp.hard_inputs", {"strategy": case.variant})


def test_lossy_error(conform, request, case):
    """A lossy contract: per step and parameter, the relative error of the full gradient (gathered with
    summon_full_params(with_grads=True)) against the exact float64 mean over ranks within the declared bound
    (the observed maximum is the ``observed_rel_error`` property), no NaN/Inf introduced, the hook's output
    in the parameter dtype."""
    lossy_cases.error_case(conform, request, case, "lossy_error", "fsdp", "strategy")


def test_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of the native path
    (the observed relative difference is the ``observed_loss_rel_diff`` property)."""
    lossy_cases.loss_case(conform, request, case, "lossy_loss", "fsdp", "strategy")


def test_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical local gradient shards (deterministic=True)."""
    lossy_cases.determinism_case(conform, request, case, "lossy_determinism", "fsdp", "strategy")
