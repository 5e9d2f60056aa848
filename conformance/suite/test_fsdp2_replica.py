"""Conformance of replica all-reduce hooks: ``FSDPModule.set_all_reduce_hook`` on a 1-D shard mesh (api ``fsdp2_replica``).

Every test here is one call, ``conform.run_case(request, case)``; the cases come
from ``conformance/apis/fsdp2_replica/plan.py``. The hook is the whole reduction
across replicas (FSDP2 all-reduces nothing on a 1-D mesh); the reference is
native HSDP on the 2-D mesh of the same ranks.
"""

from __future__ import annotations

import pytest

from conformance.suite import catalogued_tests

pytestmark = pytest.mark.conformance


def test_fsdp2_replica_parity(conform, request, case):
    """Local and full gradients, and parameters, bitwise equal to native HSDP on the 2-D mesh of the same ranks."""
    conform.run_case(request, case)


def test_fsdp2_replica_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth) with the hook as the replica all-reduce, bitwise equal to native HSDP at every one."""
    conform.run_case(request, case)


def test_fsdp2_replica_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients and per-rank magnitudes, bitwise equal to native HSDP."""
    conform.run_case(request, case)


def test_fsdp2_replica_accumulation(conform, request, case):
    """Parity with set_requires_gradient_sync(False) on all micro-batches but the last, on both models."""
    conform.run_case(request, case)


def test_fsdp2_replica_registration(conform, request, case):
    """FSDPModule.set_all_reduce_hook's rules with the replica hook on the 1-D shard mesh: unset before registration,
    on every parameter group after the suite's registration, PyTorch's ValueError on several parameter groups."""
    conform.run_case(request, case)


# The checks the catalogue plans (conformance/catalogue.py), before the switches, which run last.
globals().update(catalogued_tests(globals()))


def test_fsdp2_replica_switches(conform, request, case):
    """Replica hooks: the API's long run where the hook's switches hold at once (a buffer past its size, steps past its
    count, its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with a never-
    taken branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)
