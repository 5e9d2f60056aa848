"""Conformance of ``FullyShardedDataParallel.register_comm_hook`` hooks (the FSDP1 API).

Every test here is one call, ``conform.run_case(request, case)``: the case comes
from the API's suite test of the same name (``conformance/apis/fsdp/``), which
plans the hooks under test, the sharding strategies each serves, reference
models and world sizes (``conformance/cases.py`` says how case ids read), and
says which rank check runs and how. The behaviour comes from PyTorch's
``test/distributed/fsdp/test_fsdp_comm_hooks.py``.

A hook that claims exactness (``lossy=None``) gets averaging, parity, accumulation, subgroup
parity, clip_grad_norm_ and hard inputs; a hook with a ``LossyContract`` gets the
lossy-contract checks instead (``test_lossy_*``). Every hook gets the
registration rules and rank consistency under ``NO_SHARD``.
"""

from __future__ import annotations

import pytest

from conformance.suite import catalogued_tests

pytestmark = pytest.mark.conformance


def test_averaging(conform, request, case):
    """Linear(1, world_size) with input = rank: every gradient element is mean(0..ws-1), exactly, for 4 steps."""
    conform.run_case(request, case)


def test_parity(conform, request, case):
    """Gradients and parameters bitwise equal to the native path (no hook, or MixedPrecision(reduce_dtype))."""
    conform.run_case(request, case)


def test_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth), gradients and parameters bitwise equal to the native path at every one."""
    conform.run_case(request, case)


def test_accumulation(conform, request, case):
    """Parity under gradient accumulation: no_sync() on all micro-batches but the last; the hook is called once,
    on the locally summed gradient, and must give native's."""
    conform.run_case(request, case)


def test_subgroup_parity(conform, request, case):
    """Parity with both models and the hook's state on a data-parallel subgroup of the pool, not WORLD."""
    conform.run_case(request, case)


def test_clip_grad_norm(conform, request, case):
    """FullyShardedDataParallel.clip_grad_norm_ (norm types 2 and inf) with the hook: norm and gradients as native."""
    conform.run_case(request, case)


def test_clip_grad_norm_low_precision(conform, request, case):
    """clip_grad_norm_ with float16 gradients kept (PyTorch's test_low_precision_grads), bitwise as native."""
    conform.run_case(request, case)


def test_rank_consistency(conform, request, case):
    """Under NO_SHARD every rank holds the identical gradient after each step."""
    conform.run_case(request, case)


def test_registration(conform, request, case):
    """register_comm_hook's contract (PyTorch's test_fsdp_comm_hooks.py) with the hook under test."""
    conform.run_case(request, case)


def test_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients reduce bit for bit like the native path."""
    conform.run_case(request, case)


def test_lossy_error(conform, request, case):
    """A lossy contract: each full gradient's relative error against the exact float64 mean within the bound."""
    conform.run_case(request, case)


def test_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of the native path."""
    conform.run_case(request, case)


def test_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical local gradient shards (deterministic=True)."""
    conform.run_case(request, case)


# The checks the catalogue plans (conformance/catalogue.py), before the switches, which run last.
globals().update(catalogued_tests(globals()))


def test_switches(conform, request, case):
    """FSDP1: the API's long run where the hook's switches hold at once (a buffer past its size, steps past its count,
    its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with a never-taken
    branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)
