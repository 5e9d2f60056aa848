"""The FSDP2 reference's analytic check: native's gradients under a divide factor against the exact reduction.

Two gloo ranks build the ``fsdp2`` models of a float16 claim (the divide-factor configs gloo can run) and
train the reference one step. Native holds under every divide-factor config, the factor on every FSDP
module or on the root alone (``divide_factor_some``, PyTorch issue 157485); a reference whose gradient
lost its values (NCCL's bfloat16 ``PREMUL_SUM`` returned zeros, PyTorch issue 190745) or was divided twice
raises :class:`NativeDoesNotHold`, which the runner turns into a skip with that reason.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conformance.apis.fsdp2.build import missing_api
from conformance.apis.fsdp2.models import CommModels
from conformance.ranks.checks.models import NativeDoesNotHold

WORLD_SIZE = 2


class _Ctx:
    def __init__(self, rank: int):
        self.rank, self.world_size, self.group = rank, WORLD_SIZE, dist.group.WORLD
        self.device, self.backend = torch.device("cpu"), "gloo"

    def phase(self, text: str) -> None:
        pass


def _spoil(model: torch.nn.Module, how: str) -> None:
    grad = next(model.parameters()).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.zero_() if how == "zeroed" else local.div_(2)


def _run(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    try:
        spec = types.SimpleNamespace(name="plain", hook=None, reduce_dtype=torch.float16)
        for config in ("divide_factor", "divide_factor_force_sum", "divide_factor_some", "default"):
            for how in (None, "zeroed", "halved"):
                models = CommModels(_Ctx(rank), spec, model="nested_wrapped", config=config)
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


@pytest.mark.skipif(missing_api(("set_gradient_divide_factor",)) is not None, reason="no FSDP2 divide factor here")
def test_native_holds_its_analytic_check_and_a_spoiled_reference_does_not(tmp_path):
    mp.spawn(_run, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)
