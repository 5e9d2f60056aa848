"""Conformance of ``DistributedDataParallel.register_comm_hook`` hooks (the DDP API).

Every test here is one call, ``conform.run_case(request, case)``: the case comes
from the API's suite test of the same name (``conformance/apis/ddp/``), which
plans the DDP hooks under test, training configurations, reference models and
world sizes, and says which rank check runs and how. Test ids are
``test_ddp_<check>[{hook}-{config}-{model}-ws{N}]`` with ``config`` one of
``default``, ``small_buckets``, ``bucket_per_param``, ``subgroup``,
``bucket_view``, ``static_graph``, ``find_unused``, ``no_sync``, and, with
``--with-compiled-ddp`` only, ``compiled_autograd`` (parity under DDP's python
reducer and compiled autograd: ``conformance/apis/ddp/compiled.py``).

A hook that claims exactness (``lossy=None``) gets the averaging and parity
checks; a hook with a ``LossyContract`` gets the lossy-contract checks instead.
Every hook gets rank consistency and the future contract.

A known failure with ``run = false`` (a case that deadlocks or kills a rank)
is reported as an expected failure without being run.
"""

from __future__ import annotations

import pytest

from conformance.suite import catalogued_tests

pytestmark = pytest.mark.conformance


def test_ddp_averaging(conform, request, case):
    """Linear(1, world_size) with input = rank: every gradient element is mean(0..ws-1), exactly, for 4 steps."""
    conform.run_case(request, case)


def test_ddp_parity(conform, request, case):
    """Gradients and parameters bitwise equal to DDP with no hook (or the documented equivalent) every step."""
    conform.run_case(request, case)


def test_ddp_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth), gradients and parameters bitwise equal to DDP with no hook at every one."""
    conform.run_case(request, case)


def test_ddp_rank_consistency(conform, request, case):
    """Every rank holds the identical gradient after each step."""
    conform.run_case(request, case)


def test_ddp_future_contract(conform, request, case):
    """DDP accepts the hook; each future holds one tensor with the bucket buffer's shape, dtype and device."""
    conform.run_case(request, case)


def test_ddp_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients through the probe, bitwise equal to the reference."""
    conform.run_case(request, case)


def test_ddp_clip_grad_norm(conform, request, case):
    """torch.nn.utils.clip_grad_norm_ (norm types 2 and inf) with the hook: norm and gradients as the reference's."""
    conform.run_case(request, case)


def test_ddp_lossy_error(conform, request, case):
    """A lossy contract: each gradient's relative error against the exact float64 mean within the bound."""
    conform.run_case(request, case)


def test_ddp_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of DDP with no hook."""
    conform.run_case(request, case)


def test_ddp_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical gradients (deterministic=True)."""
    conform.run_case(request, case)


# The checks the catalogue plans (conformance/catalogue.py), before the switches, which run last.
globals().update(catalogued_tests(globals()))


def test_ddp_switches(conform, request, case):
    """DDP: the API's long run where the hook's switches hold at once (a buffer past its size, steps past its count,
    its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with a never-taken
    branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)
