"""Conformance of ``FullyShardedDataParallel.register_comm_hook`` hooks (``api="fsdp"``).

Every test here runs on the rank pool through the ``conform`` fixture and is
parametrized over the hooks under test, the sharding strategies each serves,
reference models and world sizes (see ``conformance/cases.py`` for the ids).
The behaviour comes from PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conformance import cases
from conformance.checks.fsdp import REGISTRATION_RULES
from conformance.pytest_plugin import state_of, tag
from conformance.runner import compare_across_ranks
from conformance.hard_inputs import explicit_examples, hard_gradients

pytestmark = pytest.mark.conformance(api="fsdp")


def _fsdp_specs(config):
    return [item.spec for item in state_of(config).specs if item.spec.api == "fsdp"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    state = state_of(metafunc.config)
    s = state.settings
    specs = _fsdp_specs(metafunc.config)
    main, sizes = s.world_size, s.world_sizes
    name = metafunc.function.__name__
    if name == "test_averaging":
        params = cases.training_cases(specs, sizes)
    elif name == "test_parity":
        models = {ws: cases.PARITY_MODELS if s.role(ws) == "main" else cases.EXTRA_PARITY_MODELS for ws in sizes}
        params = cases.training_cases(specs, sizes, models=models)
    elif name == "test_rank_consistency":
        models = {ws: cases.CONSISTENCY_MODELS if s.role(ws) == "main" else cases.CONSISTENCY_MODELS[:1]
                  for ws in sizes}
        params = cases.training_cases(specs, sizes, models=models, strategies=("NO_SHARD",))
    elif name == "test_registration":
        params = cases.registration_cases(specs, main, REGISTRATION_RULES)
    elif name == "test_hard_inputs":
        params = cases.training_cases(specs, sizes)
    else:
        return
    marks = []
    for p in params:
        why = s.world_size_unavailable(p.world_size)
        if why is None and p.rule == "hybrid_strategy_raises" and p.world_size < 2:
            why = "HYBRID_SHARD needs at least 2 ranks to shard over; with 1, FSDP falls back to NO_SHARD"
        if why is None and p.world_size < 2 and name == "test_rank_consistency":
            why = "rank consistency needs at least 2 ranks"
        marks.append(pytest.param(p, id=p.id, marks=[pytest.mark.skip(reason=why)] if why else []))
    metafunc.parametrize("case", marks)


def test_averaging(conform, request, case):
    """Default averaging: Linear(1, world_size), input = rank; every gradient element is mean(0..ws-1), 4 steps."""
    tag(request, case, "averaging")
    conform.run(request.node.name, check="fsdp.averaging", hook=case.hook, world_size=case.world_size,
                params={"strategy": case.variant}, describe=case.describe("averaging"))


def test_parity(conform, request, case):
    """Gradients and parameters bitwise equal to the native path (no hook, or MixedPrecision(reduce_dtype))."""
    tag(request, case, "parity")
    conform.run(request.node.name, check="fsdp.parity", hook=case.hook, world_size=case.world_size,
                params={"strategy": case.variant, "model": case.model}, describe=case.describe("parity"))


def test_rank_consistency(conform, request, case):
    """Under NO_SHARD every rank holds the identical gradient after each step."""
    tag(request, case, "rank_consistency")
    describe = case.describe("rank_consistency")
    result = conform.run(request.node.name, check="fsdp.rank_grads", hook=case.hook, world_size=case.world_size,
                         params={"strategy": case.variant, "model": case.model}, describe=describe,
                         findings=False)
    findings = [f for o in result.outcomes for f in o.value.findings]
    conform.fail_findings(request.node.name, case.hook, describe, case.world_size,
                          findings or compare_across_ranks([o.value.grads for o in result.outcomes]))


def test_registration(conform, request, case):
    """register_comm_hook's contract (PyTorch's test_fsdp_comm_hooks.py) with the hook under test."""
    tag(request, case, "registration")
    strategy = "FULL_SHARD" if case.variant == "HYBRID" else case.variant
    conform.run(request.node.name, check="fsdp.registration", hook=case.hook, world_size=case.world_size,
                params={"strategy": strategy, "rule": case.rule}, describe=case.describe("registration"))


def test_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients reduce bit for bit like the native path.

    One case carries the named explicit inputs and ``--hypothesis-examples``
    generated ones (drawn deterministically, ``derandomize=True``), so a
    failure re-runs identically from its command line.
    """
    from conformance.models import get_model

    tag(request, case, "hard_inputs")
    state = state_of(request.config)
    spec = state.spec(case.hook).spec
    shapes = get_model("gradient_probe").input_shapes()
    explicit = list(explicit_examples(case.world_size, shapes, spec.reduce_dtype).items())
    count = state.settings.hypothesis_examples

    @settings(max_examples=1, deadline=None, derandomize=True, database=None,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(generated=st.lists(hard_gradients(case.world_size, shapes, spec.reduce_dtype),
                              min_size=count, max_size=count))
    def run(generated):
        examples = explicit + [(f"generated #{i}", grads) for i, grads in enumerate(generated)]
        conform.run(request.node.name, check="fsdp.hard_inputs", hook=case.hook, world_size=case.world_size,
                    params={"strategy": case.variant, "examples": examples},
                    describe=case.describe("hard_inputs"))

    run()
