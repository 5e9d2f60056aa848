"""The DDP zoo's known-bad hooks that keep state of their own outside their state object: right for the first
model wrapped in a process, wrong for the next one (the catalogue's ``second_model`` check).

A job wraps several models in one process: a resumed run re-wraps its model, a fine-tune follows a pretraining,
a teacher model sits beside the student. DDP builds a fresh ``Reducer`` for each and the suite a fresh hook state,
so only what the hook keeps at module level carries over. Every other check trains one model per process and
passes these hooks.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec
from tests.zoo.plain_hooks import process_group_state

#: Steps this process has seen (each ends with the call of its last bucket), kept at module level.
_STEPS = [0]
#: Bucket index -> the scratch buffer the hook reduces in from the second step on: DDP rebuilds its buckets after
#: the first step, so the hook waits for the final layout, then keeps one static buffer per bucket (an
#: allocation saved every step, and addresses that stay put, as CUDA graphs want).
_STATIC: Dict[int, torch.Tensor] = {}


def bad_static_buffers_after_warm_up(process_group, bucket):
    """Averages as DDP does (multiply by ``1/world_size``, then SUM) in a scratch buffer: a fresh one in the
    process's first step, then a static one per bucket index. Both live at module level: the step count and the
    buffers of the first model wrapped in the process are what the next model gets."""
    buffer = bucket.buffer()
    if _STEPS[0] == 0:
        scratch = torch.empty_like(buffer)
    else:
        scratch = _STATIC.setdefault(bucket.index(), torch.empty_like(buffer))
    if bucket.is_last():
        _STEPS[0] += 1
    group = process_group if process_group is not None else dist.group.WORLD
    scratch.copy_(buffer).mul_(1.0 / dist.get_world_size(group))

    def back(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(scratch, group=group, async_op=True).get_future().then(back)


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_static_buffers_after_warm_up", api="ddp", hook=bad_static_buffers_after_warm_up,
             state=process_group_state),
]

#: For each known-bad hook: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_static_buffers_after_warm_up": (
        "second_model: its static buffers, made for the first model's buckets, cannot take the second model's "
        "(a RuntimeError in the hook). Within one model it is DDP's arithmetic in every config, the bucket rebuild "
        "after the first step included; only a later case of another model in the same rank process (a pool "
        "reused across cases, by accident of their order) would show it otherwise"),
}
