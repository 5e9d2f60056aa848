"""The all-gather comm's rank side: :class:`AllGatherModels`, its registration rules and :func:`hard_params`.

The comm is installed with ``FSDPModule.set_custom_all_gather`` on every FSDP
module of a model under ``fully_shard``, in a config of the API's setup object
(:data:`~conformance.apis.fsdp2_all_gather.standalone.SETUP`), through an
:class:`~conformance.apis.fsdp2_all_gather.recorder.AllGatherRecorder`; the
reference is the same model with FSDP2's own all-gather. What every FSDP2 API's
models share (meshes, builds, views) is
:class:`~conformance.apis.fsdp2_common.models.Fsdp2Models`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

import torch

from conformance.apis import REACH_MODELS
from conformance.apis.fsdp2_all_gather.arithmetic import AllGatherArithmetic
from conformance.apis.fsdp2_all_gather.recorder import AllGatherRecorder
from conformance.apis.fsdp2_all_gather.standalone import SETUP
from conformance.apis.fsdp2_common.models import Fsdp2Models
from conformance.apis.fsdp2_common.registration import ALL_GATHER
from conformance.apis.fsdp2_common.registration_rules import registration_check
from conformance.protocol import Finding
from conformance.ranks.checks.models import Recorder

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

#: ``fsdp2_all_gather.registration``: the registration rules of ``set_custom_all_gather`` with the spec's comm
#: (made by its factory, as every check makes it), on a 1-D mesh over the pool (``config="default"``).
registration = registration_check(SETUP, ALL_GATHER)

#: float32 bit patterns a parameter shard holds in :func:`hard_params`: quiet NaNs with payloads and the sign
#: bit, a signalling NaN's payload (kept by a copy, quieted by arithmetic), ``-0.0`` and ``+0.0``, the smallest
#: and the largest subnormal of each sign, the smallest normal, the largest finite of each sign, the infinities.
HARD_BITS = (0x7FC00001, 0xFFC12345, 0x7FA00001, 0x80000000, 0x00000000, 0x00000001, 0x807FFFFF, 0x007FFFFF,
             0x80000001, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000)


#: Every how many elements :func:`hard_shard` places a hard value in a shard (the others are distinct ordinary
#: values, so that a shard at a wrong offset differs wherever it lands).
HARD_SPREAD = 3


def hard_shard(numel: int, dtype: torch.dtype, rank: int, spread: int = 1) -> torch.Tensor:
    """``numel`` values of ``dtype``: every ``spread``-th element (from element 0) a hard value, starting at
    :data:`HARD_BITS` item ``rank`` (so the ranks' shards differ and a swapped shard shows), the others distinct
    ordinary values (``rank * numel + i + 1`` for element ``i``: exact in float32 below 2^24 elements, so a
    shard shifted by any offset differs). The hard values are the bit patterns themselves for float32; for
    another floating dtype the same kinds from its ``finfo`` (NaN, ``-0.0``, the smallest subnormal, the largest
    finite, the infinities)."""
    if dtype == torch.float32:
        pattern = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in HARD_BITS], dtype=torch.int32)
        pattern = pattern.view(torch.float32)
    else:
        info = torch.finfo(dtype)
        pattern = torch.tensor([float("nan"), -0.0, 0.0, info.smallest_normal * info.eps, info.tiny, info.max,
                                -info.max, float("inf"), float("-inf")], dtype=torch.float64).to(dtype)
    positions = torch.arange(numel)
    out = (positions + (rank * numel + 1)).to(torch.float64).to(dtype)
    hard = positions % spread == 0
    out[hard] = pattern[(positions[hard] // spread + rank) % pattern.numel()]
    return out


class AllGatherModels(Fsdp2Models):
    """An all-gather comm's models in ``config`` (``default``, ``no_reshard``, ``hsdp``, ``subgroup``): the
    reference is native FSDP2 in the same config (its own ``DefaultAllGather``).

    Raises:
        ValueError: ``config`` is not one of the setup's.
    """

    setup = SETUP

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str, micro_steps: int = 1):
        super().__init__(ctx, spec, model=model, config=config, micro_steps=micro_steps)
        self.arithmetic = AllGatherArithmetic(self.ctx.world_size, None)

    def recorder(self, hook: Callable[..., object]) -> Recorder:
        return AllGatherRecorder(hook, self.ctx.rank, getattr(self.ctx, "notice", None))


def hard_params(ctx: CheckContext, spec: HookSpec, *, config: str, model: str, **_: object) -> List[Finding]:
    """``fsdp2_all_gather.hard_params``: parameter shards holding NaN with payloads, ``-0.0``, subnormals and
    float extremes must arrive bit for bit. The hooked model's every local parameter shard is set to
    :func:`hard_shard` values (every :data:`HARD_SPREAD`-th a hard value, one round per starting offset: three
    rounds, one on a model of production size, whose shards hold every hard value at every offset already), then
    one forward and backward runs (FSDP2 gathers every unit, and again in the backward where it resharded); the
    recorder checks each gather against the shards, gathered again over the group FSDP2 passed. No reference:
    the values are the test.

    Returns the findings of the first round with any (on every rank, it stops where any rank found one).
    """
    models = AllGatherModels(ctx, spec, model=model, config=config)
    built = models.build(hooked=True)
    net, recorder = built.model, built.recorder
    inputs = models.inputs[0]
    for round_ in range(1 if model in REACH_MODELS else 3):
        ctx.phase(f"round {round_}: hard parameter shards through the comm")
        with torch.no_grad():
            for p in net.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.is_floating_point() and local.numel():
                    local.copy_(hard_shard(local.numel(), local.dtype, ctx.rank + round_,
                                                HARD_SPREAD).view(local.shape))
        recorder.step = round_
        models.loss_fn(inputs, net(*inputs)).backward()
        net.zero_grad(set_to_none=True)
        found = recorder.findings(round_)
        if ctx.any_rank(bool(found)):
            return [Finding(f.rank, f"hard parameter shards (round {round_}: NaN with payloads, -0.0, subnormals, "
                                    f"float extremes): {f.message}", step=f.step, kind=f.kind) for f in found]
    return []
