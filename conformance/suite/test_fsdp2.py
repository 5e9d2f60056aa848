"""Conformance of FSDP2 (``fully_shard``) custom comms and all-reduce hooks (two APIs).

Every test here is one call, ``conform.run_case(request, case)``: the case comes
from the suite test of the same name of its API (``conformance/apis/fsdp2/`` or
``conformance/apis/fsdp2_all_reduce/``), which plans it and says which rank
check runs and how.

A ``ReduceScatter`` comm installed with ``FSDPModule.set_custom_reduce_scatter``
on every FSDP module must give gradients (local shards and full tensors) and
parameters bitwise equal to native ``fully_shard`` under the same
``MixedPrecisionPolicy(reduce_dtype=...)``, under each FSDP2 config. A hook
installed with ``FSDPModule.set_all_reduce_hook`` under native HSDP (2 x
world_size/2 mesh) must leave every gradient bitwise as native HSDP without it.

HSDP needs 4 ranks: it runs at the smallest world size of the run that fits a
2-D mesh (4+ GPUs: the main pool), else on an extra 4-rank pool (the default
CPU run, 2 and 3 ranks).

A comm with a ``LossyContract`` gets the lossy-contract checks
(``test_fsdp2_lossy_*``) instead of parity, hard inputs and clip_grad_norm_; an
all-reduce hook cannot declare one. Every hook gets the registration rules
(``test_fsdp2_registration``, ``test_fsdp2_all_reduce_registration``; ids
``{hook}-{config}-{rule}``), which hold whatever the hook is: where this torch
breaks one the case is skipped ("PyTorch changed"), where the suite's own
registration does it is ``NOT RUN``; never the hook's failure.

Case ids: ``{hook}-{config}-{model}-ws{N}``; ``-k fsdp2`` selects this module.
"""

from __future__ import annotations

import pytest

from conformance.suite import catalogued_tests

pytestmark = pytest.mark.conformance


def test_fsdp2_parity(conform, request, case):
    """A custom reduce-scatter comm: local/full gradients and parameters bitwise equal to native fully_shard."""
    conform.run_case(request, case)


def test_fsdp2_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth) with the comm on every FSDP module, bitwise equal to native FSDP2 at every one."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_hook(conform, request, case):
    """An all-reduce hook under native HSDP: gradients and parameters bitwise equal to HSDP without it."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_long_run(conform, request, case):
    """256 steps (2,000 at nightly depth) under replicate with the hook, bitwise equal to native at every one."""
    conform.run_case(request, case)


def test_fsdp2_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients through the comm, bitwise equal to native fully_shard."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_hard_inputs(conform, request, case):
    """The same hard inputs under native HSDP with the all-reduce hook: bitwise equal to HSDP without it."""
    conform.run_case(request, case)


def test_fsdp2_clip_grad_norm(conform, request, case):
    """torch.nn.utils.clip_grad_norm_ (norm types 2 and inf) over DTensor gradients, bitwise equal to native."""
    conform.run_case(request, case)


def test_fsdp2_accumulation(conform, request, case):
    """Parity under gradient accumulation: set_requires_gradient_sync(False) on all micro-batches but the last
    (under HSDP set_requires_all_reduce(False)); bitwise equal to native fully_shard accumulating alike."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_accumulation(conform, request, case):
    """An all-reduce hook under HSDP with set_requires_all_reduce(False) on all micro-batches but the last: called
    once, on the accumulated reduce-scatter output, and bitwise equal to HSDP without it."""
    conform.run_case(request, case)


def test_fsdp2_lossy_error(conform, request, case):
    """A comm with a lossy contract: each full gradient's relative error against the exact mean within the bound."""
    conform.run_case(request, case)


def test_fsdp2_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of native fully_shard."""
    conform.run_case(request, case)


def test_fsdp2_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical local gradient shards (deterministic=True)."""
    conform.run_case(request, case)


def test_fsdp2_registration(conform, request, case):
    """FSDPModule.set_custom_reduce_scatter's rules with the comm under test: unset before registration, on every
    parameter group after the suite's registration (the root's alone leaves the children native), and PyTorch's
    ValueError on a module with several parameter groups, which the suite reports naming the module and the fix."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_registration(conform, request, case):
    """FSDPModule.set_all_reduce_hook's rules with the hook under test under native HSDP: the same three rules, and
    its ValueError for a stream under native HSDP."""
    conform.run_case(request, case)


# The checks the catalogue plans (conformance/catalogue.py), before the switches, which run last.
globals().update(catalogued_tests(globals()))


def test_fsdp2_switches(conform, request, case):
    """FSDP2 comms: the API's long run where the hook's switches hold at once (a buffer past its size, steps past its
    count, its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with a never-
    taken branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)


def test_fsdp2_all_reduce_switches(conform, request, case):
    """FSDP2 all-reduce hooks: the API's long run where the hook's switches hold at once (a buffer past its size, steps
    past its count, its node layout): a spec's named ``switches`` at every depth; at nightly depth, for a hook with
    a never-taken branch after its other cases, 300 steps on 4.25 MiB over 2 nodes. Runs last: it reads what ran."""
    conform.run_case(request, case)
