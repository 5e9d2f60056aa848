"""The FSDP2 zoo's reduce-scatter comms whose ``allocate`` breaks FSDP2's contract (the wrong dtype, a padded
shape, views of one persistent buffer), each with its ``HookSpec`` and the config that must catch it.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter
from conformance.spec import HookSpec


class Float32AllocComm(PlainReduceScatter):
    """Wrong dtype: ``allocate`` ignores ``dtype`` and always returns float32.

    Under ``MixedPrecisionPolicy(reduce_dtype=bfloat16/float16)`` FSDP2 then copies the
    gradients into float32 buffers, so they are never rounded to the reduce dtype and the
    reduction runs in float32. Realistic: ``torch.empty(size, device=device)`` with the dtype
    forgotten; invisible in full precision.
    """

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, device=device)


class PaddedAllocComm(PlainReduceScatter):
    """Wrong shape: ``allocate`` rounds every buffer up to a multiple of 64 elements.

    FSDP2 views the reduce-scatter input as ``(world_size, -1)`` and hands the output buffer
    to the collective as it is, so the padded buffers do not fit the shards: the
    reduce-scatter raises a size check. Realistic: alignment padding copied from a
    registered-memory allocator.
    """

    ALIGN = 64

    def allocate(self, size, *, dtype, device):
        numel = 1
        for s in size:
            numel *= int(s)
        return torch.empty(-(-numel // self.ALIGN) * self.ALIGN, dtype=dtype, device=device)


class StagingBufferComm(PlainReduceScatter):
    """Wrong: ``allocate`` hands out views of one persistent staging buffer.

    Every allocation starts at offset 0, so the reduce-scatter input and output alias, and
    FSDP2's sharded gradients (views into the output buffer) are overwritten by the next FSDP
    module's reduction. Realistic: a "registered buffer" optimisation that assumes each buffer
    is dead once the collective returns.
    """

    def __init__(self) -> None:
        self.buffers: Dict[Any, torch.Tensor] = {}

    def allocate(self, size, *, dtype, device):
        numel = 1
        for s in size:
            numel *= int(s)
        key = (dtype, str(device))
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel].view(*size)


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_fp32_alloc_bf16", api="fsdp2", hook=Float32AllocComm, reduce_dtype=torch.bfloat16,
             description="allocate ignores dtype (float32 buffers) under reduce_dtype=bfloat16"),
    HookSpec(name="bad_padded_alloc", api="fsdp2", hook=PaddedAllocComm,
             description="allocate pads every buffer to a multiple of 64 elements (wrong shape)"),
    HookSpec(name="bad_staging_buffer", api="fsdp2", hook=StagingBufferComm,
             description="allocate returns views of one persistent buffer (input/output alias)"),
]

#: For each known-bad spec here, the config that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_fp32_alloc_bf16": (
        "default: the gradients are reduced in float32 instead of bfloat16 (and the allocation check "
        "names the float32 buffer); in full precision the same comm is right"
    ),
    "bad_padded_alloc": (
        "default: the reduce-scatter raises on the padded buffers; the allocation check names the "
        "wrong shape above the rank's traceback"
    ),
    "bad_staging_buffer": "default: input and output alias and later modules overwrite earlier gradients",
}
