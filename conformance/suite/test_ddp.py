"""Conformance of ``DistributedDataParallel.register_comm_hook`` hooks (``api="ddp"``).

Every test here runs on the rank pool through the ``conform`` fixture and is
parametrized by the DDP adapter's case plan (``conformance/apis/ddp/adapter.py``):
the DDP hooks under test, training configurations, reference models and world
sizes. Test ids are ``test_ddp_<check>[{hook}-{config}-{model}-ws{N}]``
with ``config`` one of ``default``, ``small_buckets``, ``bucket_view``,
``static_graph``, ``find_unused``, ``no_sync`` (see ``conformance/apis/ddp/adapter.py``).

A hook that claims exactness (``lossy=None``) gets the averaging and parity
checks; a hook with a ``LossyContract`` gets the lossy-contract checks instead.
Every hook gets rank consistency and the future contract.

A known failure with ``run = false`` (a case that deadlocks or kills a rank)
is reported as an expected failure without being run.
"""

from __future__ import annotations

import pytest

from conformance.controller import lossy_cases
from conformance.controller.hard_inputs import check_case

pytestmark = pytest.mark.conformance(api="ddp")


def test_ddp_averaging(conform, request, case):
    """Linear(1, world_size), input = rank: every gradient element is mean(0..ws-1), exactly, for 4 steps."""
    lossy_cases.exact_case(conform, request, case, "averaging", "ddp.averaging", {})


def test_ddp_parity(conform, request, case):
    """Gradients and parameters bitwise equal to DDP with no hook (or the documented reduced-precision
    equivalent) after every step, per parameter."""
    lossy_cases.exact_case(conform, request, case, "parity", "ddp.parity",
                           {"config": case.variant, "model": case.model})


def test_ddp_rank_consistency(conform, request, case):
    """Every rank holds the identical gradient after each step."""
    conform.check(request, case, "rank_consistency", "ddp.rank_grads",
                  {"config": case.variant, "model": case.model}, across_ranks=True)


def test_ddp_future_contract(conform, request, case):
    """DDP accepts the hook; each future holds one tensor with the bucket buffer's shape, dtype and device."""
    conform.check(request, case, "future_contract", "ddp.future_contract",
                  {"config": case.variant, "model": case.model})


def test_ddp_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients through the probe, bitwise equal to the reference
    in each config; generated examples shrink to a minimal one on failure."""
    check_case(conform, request, case, "hard_inputs", "ddp.hard_inputs", {"config": case.variant})


def test_ddp_clip_grad_norm(conform, request, case):
    """torch.nn.utils.clip_grad_norm_ (norm types 2 and inf) on the DDP model with the hook registered: the
    total norm and the clipped gradients bitwise equal to the reference's."""
    conform.check(request, case, "clip_grad_norm", "ddp.clip_grad_norm", {"config": case.variant, "model": case.model})


def test_ddp_lossy_error(conform, request, case):
    """Per step and parameter: relative error against the exact mean within the declared bound (the
    observed maximum is reported as the ``observed_rel_error`` property), and no NaN/Inf introduced."""
    lossy_cases.error_case(conform, request, case, "lossy_error", "ddp", "config")


def test_ddp_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of DDP with no hook
    (the observed relative difference is the ``observed_loss_rel_diff`` property)."""
    lossy_cases.loss_case(conform, request, case, "lossy_loss", "ddp", "config")


def test_ddp_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical gradients (declared deterministic=True)."""
    lossy_cases.determinism_case(conform, request, case, "lossy_determinism", "ddp", "config")
