"""A zoo of hooks meant for one parameter dtype (``HookSpec.param_dtype``, issue 30): known-good and known-bad.

Large models train with bfloat16 parameters (torchtitan's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``). Two classes of hook are written for that and nothing else:

* **bfloat16 on the wire**: a comm or hook that casts its buffer to bfloat16, reduces, and casts back. With
  bfloat16 parameters and no reduce dtype (FSDP reduces in the parameter dtype) the buffer is bfloat16
  already, the casts change nothing and the hook is native bit for bit; with float32 parameters it rounds
  every gradient. The same hook passes under its claim and fails without it, for each API (FSDP2's custom
  reduce-scatter, FSDP1's and DDP's ``register_comm_hook``); FSDP2's all-gather comm gathers the
  parameters in the parameter dtype, so a bfloat16 all-gather is exact under the claim (its unclaimed
  twin is ``tests/zoo/fsdp2_all_gathers.py``'s ``bad_bf16_wire``).
* **bfloat16-valued gradients assumed**: under ``param_dtype=bfloat16, reduce_dtype=float32`` FSDP2 hands
  the comm float32 gradients that hold bfloat16 values after one micro-batch (the backward ran in
  bfloat16), so a comm that stages them in a bfloat16 buffer (half the memory) loses nothing there. Under
  gradient accumulation FSDP2 accumulates the unsharded gradients in the reduce dtype (PyTorch PR 125191):
  the comm then gets the float32 sum of several micro-batches, no longer bfloat16 values, and the staging
  rounds it. Parity passes it; only accumulation under the claim catches it.

Established on gloo, torch 2.13 CPU, 2 ranks, 3 steps, against native FSDP2 / FSDP1 / DDP (small scripts
of the issue-30 work, summarised in docs/checks.md#parameter-dtype): the comm's input is
float32 and bfloat16-valued on one micro-batch, float32 and not bfloat16-valued on the synchronising one of
two; the staging comm is bitwise native with one micro-batch and differs with two; the wire comm is
bitwise native under ``param_dtype=bfloat16`` (reduce dtype ``None``: its input is bfloat16) and differs
with float32 parameters.

Only ``torch`` is imported at module level besides the specs' types: the zoo is imported by the controller
and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter
from conformance.spec import HookSpec
from tests.zoo.fsdp2_all_gathers import Bf16Wire as Bf16WireAllGather
from tests.zoo.fsdp2_comms import Bf16WireComm
from tests.zoo.plain_hooks import process_group_state

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD"]


class Bf16StagingComm(PlainReduceScatter):
    """Stages the reduce-scatter input in a bfloat16 buffer (half the memory) until the collective, then
    reduce-scatters it in the reduce dtype with FSDP2's ``op``: lossless while the gradients hold bfloat16
    values (one micro-batch of a bfloat16 backward), lossy once FSDP2 hands it a float32 sum of several."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        staged = input_tensor.to(torch.bfloat16)
        return super().__call__(output_tensor, staged.to(input_tensor.dtype), group, op, async_op)


def fsdp_state(group):
    """FSDP1's ``DefaultState`` (its pre- and post-divide factors), looked up when a rank builds it."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    return DefaultState(group)


def fsdp_bf16_wire_hook(state, grad, output=None):
    """FSDP1: pre-divide, reduce and post-divide in bfloat16, as ``MixedPrecision(reduce_dtype=bfloat16)``
    does, the result copied back into the dtype the gradient arrived in; written for bfloat16 parameters,
    where FSDP hands it bfloat16 gradients and every cast is exact."""
    low = grad.to(torch.bfloat16)
    if state.gradient_predivide_factor > 1:
        low.div_(state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(low, group=state.process_group)
        result, target = low, grad
    else:
        result = torch.empty(output.shape, dtype=torch.bfloat16, device=output.device)
        dist.reduce_scatter_tensor(result, low, group=state.process_group)
        target = output
    if state.gradient_postdivide_factor > 1:
        result.div_(state.gradient_postdivide_factor)
    target.copy_(result)


def ddp_bf16_wire_hook(process_group, bucket):
    """DDP: the bucket cast to bfloat16, scaled by ``1/world_size`` and SUM all-reduced, cast back; written for
    a model in bfloat16, where the bucket is bfloat16 and it is DDP's own averaging."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).mul_(1.0 / process_group.size())
    work = dist.all_reduce(low, group=process_group, async_op=True)
    return work.get_future().then(lambda f: buffer.copy_(f.value()[0]))


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_bf16_wire_params_bf16", api="fsdp2", hook=Bf16WireComm, param_dtype=torch.bfloat16,
             description="bfloat16 on the wire, claimed for bfloat16 parameters: exact there"),
    HookSpec(name="good_all_gather_bf16_wire_params_bf16", api="fsdp2_all_gather", hook=Bf16WireAllGather,
             param_dtype=torch.bfloat16,
             description="all-gather in bfloat16, claimed for bfloat16 parameters (its unclaimed twin: the "
                         "all-gather zoo's bad_bf16_wire)"),
    HookSpec(name="good_plain_params_bf16_fp32", api="fsdp2", hook=PlainReduceScatter,
             param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             description="the staging comm's good twin: the float32 input reduce-scattered as it is"),
    HookSpec(name="good_fsdp_bf16_wire_params_bf16", api="fsdp", hook=fsdp_bf16_wire_hook,
             state=fsdp_state, param_dtype=torch.bfloat16,
             description="FSDP1 hook reducing in bfloat16, claimed for bfloat16 parameters"),
    HookSpec(name="good_ddp_bf16_wire_params_bf16", api="ddp", hook=ddp_bf16_wire_hook, state=process_group_state,
             param_dtype=torch.bfloat16, description="DDP hook reducing in bfloat16, claimed for a bfloat16 model"),
]

KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_bf16_wire_params_fp32", api="fsdp2", hook=Bf16WireComm,
             description="the same bfloat16 wire comm with no parameter-dtype claim: float32 parameters"),
    HookSpec(name="bad_fsdp_bf16_wire_params_fp32", api="fsdp", hook=fsdp_bf16_wire_hook,
             state=fsdp_state,
             description="the same FSDP1 hook with no claim: it rounds float32 gradients"),
    HookSpec(name="bad_ddp_bf16_wire_params_fp32", api="ddp", hook=ddp_bf16_wire_hook, state=process_group_state,
             description="the same DDP hook with no claim: it rounds float32 buckets"),
    HookSpec(name="bad_bf16_staging_params_bf16", api="fsdp2", hook=Bf16StagingComm,
             param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             description="stages float32 gradients in bfloat16, assuming bfloat16 values"),
]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: For each known-bad spec, the check that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_bf16_wire_params_fp32": "fsdp2_parity: float32 gradients rounded to bfloat16 on the wire",
    "bad_fsdp_bf16_wire_params_fp32": "parity: float32 gradients reduced in bfloat16",
    "bad_ddp_bf16_wire_params_fp32": "parity: float32 buckets reduced in bfloat16",
    "bad_bf16_staging_params_bf16": (
        "fsdp2_accumulation only: one micro-batch of a bfloat16 backward gives bfloat16-valued gradients, which "
        "the staging keeps; the float32 sum FSDP2 accumulates over micro-batches (PR 125191) it rounds, and "
        "fsdp2_parity passes it"),
}
