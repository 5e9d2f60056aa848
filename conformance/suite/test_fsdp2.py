"""Conformance of FSDP2 (``fully_shard``) custom comms and all-reduce hooks.

``api="fsdp2"``: a ``ReduceScatter`` comm installed with
``FSDPModule.set_custom_reduce_scatter`` on every FSDP module must give
gradients (local shards and full tensors) and parameters bitwise equal to
native ``fully_shard`` under the same ``MixedPrecisionPolicy(reduce_dtype=...)``,
under each config of :data:`conformance.apis.fsdp2.adapter.CONFIGS`.

``api="fsdp2_all_reduce"``: a hook installed with ``FSDPModule.set_all_reduce_hook``
under native HSDP (2 x world_size/2 mesh) must leave every gradient bitwise as
native HSDP without it.

HSDP needs 4 ranks: it runs at the smallest world size of the run that fits a
2-D mesh (4+ GPUs: the main pool), else on an extra 4-rank pool (the default
CPU run, 2 and 3 ranks); see :data:`conformance.apis.fsdp2.adapter.START_HSDP_POOL`.
The case plans are the FSDP2 adapter's (``conformance/apis/fsdp2/adapter.py``).

A comm with a ``LossyContract`` gets the lossy-contract checks
(``test_fsdp2_lossy_*``) instead of parity, hard inputs and clip_grad_norm_; an
all-reduce hook cannot declare one (``conformance.apis.fsdp2.adapter.validate_all_reduce_hook``).

Case ids: ``{hook}-{config}-{model}-ws{N}``; ``-k fsdp2`` selects this module.
"""

from __future__ import annotations

import pytest

from conformance.controller import lossy_cases
from conformance.controller.hard_inputs import check_case

pytestmark = pytest.mark.conformance(api="fsdp2")


def test_fsdp2_parity(conform, request, case):
    """A custom reduce-scatter comm: local/full gradients and parameters bitwise equal to native fully_shard."""
    lossy_cases.exact_case(conform, request, case, "fsdp2_parity", "fsdp2.parity",
                           {"config": case.variant, "model": case.model})


def test_fsdp2_all_reduce_hook(conform, request, case):
    """An all-reduce hook under native HSDP: gradients and parameters bitwise equal to HSDP without it."""
    conform.check(request, case, "fsdp2_all_reduce_hook", "fsdp2.all_reduce_parity", {"model": case.model})


def test_fsdp2_hard_inputs(conform, request, case):
    """Near-overflow, zero, subnormal, NaN and Inf gradients through the probe, the comm installed: bitwise
    equal to native fully_shard; generated examples shrink to a minimal one on failure."""
    check_case(conform, request, case, "fsdp2_hard_inputs", "fsdp2.hard_inputs", {"config": case.variant})


def test_fsdp2_all_reduce_hard_inputs(conform, request, case):
    """The same hard inputs under native HSDP with the all-reduce hook: bitwise equal to HSDP without it."""
    check_case(conform, request, case, "fsdp2_all_reduce_hard_inputs", "fsdp2.all_reduce_hard_inputs", {})


def test_fsdp2_clip_grad_norm(conform, request, case):
    """torch.nn.utils.clip_grad_norm_ (norm types 2 and inf) over the DTensor gradients with the comm installed:
    the total norm and the clipped gradients bitwise equal to native fully_shard."""
    conform.check(request, case, "fsdp2_clip_grad_norm", "fsdp2.clip_grad_norm",
                  {"config": case.variant, "model": case.model})


def test_fsdp2_lossy_error(conform, request, case):
    """A comm with a lossy contract: per step and parameter, the relative error of the full gradient
    (full_tensor()) against the exact float64 mean over ranks within the declared bound (the observed maximum
    is the ``observed_rel_error`` property), no NaN/Inf introduced, allocate's buffers as asked."""
    lossy_cases.error_case(conform, request, case, "fsdp2_lossy_error", "fsdp2", "config")


def test_fsdp2_lossy_loss(conform, request, case):
    """After ``loss_steps`` SGD steps the training loss is within the declared margin of native fully_shard
    (the observed relative difference is the ``observed_loss_rel_diff`` property)."""
    lossy_cases.loss_case(conform, request, case, "fsdp2_lossy_loss", "fsdp2", "config")


def test_fsdp2_lossy_determinism(conform, request, case):
    """Two trainings from the same seed give bitwise identical local gradient shards (deterministic=True)."""
    lossy_cases.determinism_case(conform, request, case, "fsdp2_lossy_determinism", "fsdp2", "config")
