"""Conformance of ``FullyShardedDataParallel.register_comm_hook`` hooks (``api="fsdp"``).

Every test here runs on the rank pool through the ``conform`` fixture and is
parametrized by the FSDP adapter's case plan (``conformance/adapters/fsdp.py``):
the hooks under test, the sharding strategies each serves, reference models
and world sizes (``conformance/cases.py`` says how case ids read).
The behaviour comes from PyTorch's ``test/distributed/fsdp/test_fsdp_comm_hooks.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conformance.hard_inputs import explicit_examples, hard_gradients
from conformance.pytest_plugin import state_of, tag

pytestmark = pytest.mark.conformance(api="fsdp")


def test_averaging(conform, request, case):
    """Default averaging: Linear(1, world_size), input = rank; every gradient element is mean(0..ws-1), 4 steps."""
    conform.check(request, case, "averaging", "fsdp.averaging", {"strategy": case.variant})


def test_parity(conform, request, case):
    """Gradients and parameters bitwise equal to the native path (no hook, or MixedPrecision(reduce_dtype))."""
    conform.check(request, case, "parity", "fsdp.parity", {"strategy": case.variant, "model": case.model})


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
