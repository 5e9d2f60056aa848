"""Conformance of ``DistributedDataParallel.register_comm_hook`` hooks (``api="ddp"``).

Every test here runs on the rank pool through the ``conform`` fixture and is
parametrized by the DDP adapter's case plan (``conformance/adapters/ddp.py``):
the DDP hooks under test, training configurations, reference models and world
sizes. Test ids are ``test_ddp_<check>[{hook}-{config}-{model}-ws{N}]``
with ``config`` one of ``default``, ``small_buckets``, ``bucket_view``,
``static_graph``, ``find_unused``, ``no_sync`` (see ``conformance/adapters/ddp.py``).

A hook that claims exactness (``lossy=None``) gets the averaging and parity
checks; a hook with a ``LossyContract`` gets the lossy-contract checks instead.
Every hook gets rank consistency and the future contract.

A known failure with ``run = false`` (a case that deadlocks or kills a rank)
is reported as an expected failure without being run.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import pytest

from conformance import cases
from conformance.adapters.ddp import DECLARE_LOSSY_HINT
from conformance.pytest_plugin import state_of, tag
from conformance.runner import compare_across_ranks

pytestmark = pytest.mark.conformance(api="ddp")


def _spec(request: pytest.FixtureRequest, case: cases.CaseParams) -> Any:
    return state_of(request.config).spec(case.hook).spec


def _run_exact(conform, request, case, check: str, rank_check: str, params: Dict[str, Any]) -> None:
    """Run an exactness check; for a hook with no lossy contract, a failure says how to declare one."""
    describe = tag(request, case, check)
    result = conform.run(request.node.name, check=rank_check, hook=case.hook, world_size=case.world_size,
                         params=params, describe=describe, findings=False)
    found = [f for o in result.outcomes for f in o.value.findings]
    # A lossy hook may declare a contract; a hook that never communicates is not lossy.
    hint = _spec(request, case).lossy is None and not any(f.kind == "local_gradient" for f in found)
    conform.fail_findings(request.node.name, case.hook, describe, case.world_size, found,
                          note="  " + DECLARE_LOSSY_HINT if hint else "")


def test_ddp_averaging(conform, request, case):
    """Linear(1, world_size), input = rank: every gradient element is mean(0..ws-1), exactly, for 4 steps."""
    _run_exact(conform, request, case, "averaging", "ddp.averaging", {})


def test_ddp_parity(conform, request, case):
    """Gradients and parameters bitwise equal to DDP with no hook (or the documented reduced-precision
    equivalent) after every step, per parameter."""
    _run_exact(conform, request, case, "parity", "ddp.parity", {"config": case.variant, "model": case.model})


def test_ddp_rank_consistency(conform, request, case):
    """Every rank holds the identical gradient after each step."""
    describe = tag(request, case, "rank_consistency")
    result = conform.run(request.node.name, check="ddp.rank_grads", hook=case.hook, world_size=case.world_size,
                         params={"config": case.variant, "model": case.model}, describe=describe,
                         findings=False)
    findings = [f for o in result.outcomes for f in o.value.findings]
    if not findings:
        findings = compare_across_ranks([o.value.grads for o in result.outcomes])
    conform.fail_findings(request.node.name, case.hook, describe, case.world_size, findings)


def test_ddp_future_contract(conform, request, case):
    """DDP accepts the hook; each future holds one tensor with the bucket buffer's shape, dtype and device."""
    describe = tag(request, case, "future_contract")
    conform.run(request.node.name, check="ddp.future_contract", hook=case.hook, world_size=case.world_size,
                params={"config": case.variant, "model": case.model}, describe=describe)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3e}"


def test_ddp_lossy_error(conform, request, case):
    """Per step and parameter: relative error against the exact mean within the declared bound (the
    observed maximum is reported as the ``observed_rel_error`` property), and no NaN/Inf introduced."""
    describe = tag(request, case, "lossy_error")
    spec = _spec(request, case)
    result = conform.run(request.node.name, check="ddp.lossy_error", hook=case.hook, world_size=case.world_size,
                         params={"config": case.variant, "model": case.model}, describe=describe,
                         findings=False)
    values = [o.value for o in result.outcomes]
    worst = max(values, key=lambda v: v.figures["max_rel_error"]).figures
    figure = _fmt(worst["max_rel_error"])
    request.node.user_properties.append(("observed_rel_error", figure))
    bound = spec.lossy.rel_error_bound
    where = ""
    if worst["at"] is not None:
        where = f" (step {worst['at'][0]}, parameter {worst['at'][1]!r})"
    summary = (f"  observed max relative error {figure}{where}; declared rel_error_bound "
               f"{'none' if bound is None else _fmt(bound)}")
    conform.fail_findings(request.node.name, case.hook, describe, case.world_size,
                          [f for v in values for f in v.findings], note=summary)


def test_ddp_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of DDP with no hook
    (the observed relative difference is the ``observed_loss_rel_diff`` property)."""
    describe = tag(request, case, "lossy_loss")
    spec = _spec(request, case)
    result = conform.run(request.node.name, check="ddp.lossy_loss", hook=case.hook, world_size=case.world_size,
                         params={"config": case.variant, "model": case.model}, describe=describe,
                         findings=False)
    value = result.outcomes[0].value.figures
    figure = _fmt(value["rel_diff"])
    request.node.user_properties.append(("observed_loss_rel_diff", figure))
    findings = [f for o in result.outcomes for f in o.value.findings]
    if findings:
        summary = (f"  observed relative loss difference {figure} after {spec.lossy.loss_steps} steps "
                   f"(loss {value['loss_hook']!r} with the hook, {value['loss_exact']!r} without); declared "
                   f"loss_margin {_fmt(spec.lossy.loss_margin)}")
        conform.fail_findings(request.node.name, case.hook, describe, case.world_size, findings, note=summary)


def test_ddp_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical gradients (declared deterministic=True)."""
    describe = tag(request, case, "lossy_determinism")
    conform.run(request.node.name, check="ddp.lossy_determinism", hook=case.hook, world_size=case.world_size,
                params={"config": case.variant, "model": case.model}, describe=describe)
