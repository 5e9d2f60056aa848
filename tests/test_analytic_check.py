"""The FSDP2 reference's analytic check: native's gradients under a divide factor against the exact reduction.

Two gloo ranks (four for HSDP) build the ``fsdp2`` models of a float16 claim (the divide-factor configs gloo
can run) and train the reference one step. Native holds under every divide-factor config, the factor on
every FSDP module, on the root alone (``divide_factor_some``, PyTorch issue 157485), or under HSDP, where it
must divide the SUM over every rank as the flattened 1-D mesh does (issue 155903); a reference whose gradient
lost its values (NCCL's bfloat16 ``PREMUL_SUM`` returned zeros, PyTorch issue 190745) or was divided twice
raises :class:`NativeDoesNotHold`, which the runner turns into a skip with that reason.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conformance.apis.fsdp2_common.build import missing_api
from conformance.apis.fsdp2.models import CommModels
from conformance.ranks.checks.models import NativeDoesNotHold

class _Ctx:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.group = rank, world_size, dist.group.WORLD
        self.device, self.backend = torch.device("cpu"), "gloo"

    def phase(self, text: str) -> None:
        pass


def _spoil(model: torch.nn.Module, how: str) -> None:
    grad = next(model.parameters()).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.zero_() if how == "zeroed" else local.div_(2)


def _run(rank: int, store_path: str, world_size: int, configs: tuple) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        spec = types.SimpleNamespace(name="plain", hook=None, reduce_dtype=torch.float16, param_dtype=None)
        for config in configs:
            for how in (None, "zeroed", "halved"):
                models = CommModels(_Ctx(rank, world_size), spec, model="nested_wrapped", config=config)
                ref = models.build(hooked=False).model
                for micro in models.inputs:
                    models.loss_fn(micro, ref(*micro)).backward()
                if how is None or config == "default":  # native holds; no divide factor: no analytic check
                    if how is not None:
                        _spoil(ref, how)
                    models.check_reference(ref, models.inputs, 0)
                    continue
                _spoil(ref, how)
                with pytest.raises(NativeDoesNotHold, match="is not the exact SUM over ranks divided by"):
                    models.check_reference(ref, models.inputs, 0)
    finally:
        dist.destroy_process_group()
    # Leave at once: the teardown of FSDP2's and gloo's threads can abort a process whose checks all held
    # ("terminate called without an active exception"), which mp.spawn reports as this rank's failure.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.skipif(missing_api(("set_gradient_divide_factor",)) is not None, reason="no FSDP2 divide factor here")
def test_native_holds_its_analytic_check_and_a_spoiled_reference_does_not(tmp_path):
    configs = ("divide_factor", "divide_factor_force_sum", "divide_factor_some", "default")
    mp.spawn(_run, args=(str(tmp_path / "store"), 2, configs), nprocs=2, join=True)


@pytest.mark.skipif(missing_api(("set_gradient_divide_factor",)) is not None, reason="no FSDP2 divide factor here")
def test_hsdp_with_a_divide_factor_divides_the_sum_over_every_rank(tmp_path):
    """Under HSDP (2 x 2 mesh) the factor divides the SUM over all 4 ranks, as on the flattened 1-D mesh
    (PyTorch issue 155903 found them inconsistent)."""
    mp.spawn(_run, args=(str(tmp_path / "store"), 4, ("hsdp_divide_factor",)), nprocs=4, join=True)
