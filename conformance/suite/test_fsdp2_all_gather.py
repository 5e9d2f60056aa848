"""Conformance of FSDP2 custom all-gather comms: ``FSDPModule.set_custom_all_gather`` (api ``fsdp2_all_gather``).

Every test here is one call, ``conform.run_case(request, case)``; the cases come
from ``conformance/apis/fsdp2_all_gather/plan.py``. The comm gathers the
parameter shards FSDP2 uses in the forward and the backward: it must leave the
shards of the group FSDP2 passes, in rank order, bit for bit; the reference is
native FSDP2 (its own all-gather) in the same config.
"""

from __future__ import annotations

import pytest

from conformance.suite import catalogued_tests

pytestmark = pytest.mark.conformance


def test_fsdp2_all_gather_parity(conform, request, case):
    """Losses, local gradient shards and parameter shards bitwise equal to native FSDP2 after every step, every
    gather checked against the group's shards, with and without reshard_after_forward, on HSDP and a sub-mesh."""
    conform.run_case(request, case)


def test_fsdp2_all_gather_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth) with the comm on every FSDP module, bitwise equal to native FSDP2 at every
    one."""
    conform.run_case(request, case)


def test_fsdp2_all_gather_hard_params(conform, request, case):
    """Parameter shards holding NaN with payloads, -0.0, subnormals and float extremes gathered bit for bit."""
    conform.run_case(request, case)


def test_fsdp2_all_gather_accumulation(conform, request, case):
    """Parity over micro-batches, all but the last under set_requires_gradient_sync(False): FSDP2 gathers in each
    one, a unit only the last micro-batch uses once a step."""
    conform.run_case(request, case)


def test_fsdp2_all_gather_clip_grad_norm(conform, request, case):
    """clip_grad_norm_ on the gathered parameters' gradients, with the comm installed, equal to native FSDP2."""
    conform.run_case(request, case)


def test_fsdp2_all_gather_registration(conform, request, case):
    """FSDPModule.set_custom_all_gather's rules: unset before registration, on every parameter group after the
    suite's registration, PyTorch's ValueError on several parameter groups."""
    conform.run_case(request, case)


# The checks the catalogue plans (conformance/catalogue.py), before the switches, which run last.
globals().update(catalogued_tests(globals()))


def test_fsdp2_all_gather_switches(conform, request, case):
    """All-gather comms: the API's long run where the hook's switches hold at once (a buffer past its size, steps past
    its count, its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with a
    never-taken branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)
