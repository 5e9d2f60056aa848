"""A DDP hook that is right in one config only: it reduces ``p.grad`` and returns the unreduced bucket.

The pattern comes from a public climate-model codebase (issue 9). The hook
averages each parameter's ``p.grad`` across ranks, exactly as DDP does
(multiply by ``1 / world_size``, then SUM), and hands DDP back
``bucket.buffer()`` untouched. With ``gradient_as_bucket_view=True`` each
``p.grad`` is a view into that buffer, so the buffer it returns is the reduced
one and the hook conforms bit for bit. In every other config the buffer holds
copies of the local gradients, and DDP copies the future's value over
``p.grad`` after the hook: the reduction is overwritten, every rank keeps its
local gradient. So the hook fails in every config except ``bucket_view``; the
per-hook grid of the summary (``conformance/matrix.py``) shows that pattern,
which ``tests/test_results_run.py`` asserts.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec
from tests.zoo.ddp_hooks import process_group_state

__all__ = ["SPECS", "bad_reduces_grads_returns_bucket"]


def bad_reduces_grads_returns_bucket(process_group, bucket):
    """Average every ``p.grad`` of the bucket in place (1/world_size, then SUM); return the bucket unreduced.

    No annotations: DDP refuses a hook whose ``bucket`` is annotated as anything but ``dist.GradBucket``.
    """
    scale = 1.0 / process_group.size()
    for p in bucket.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
            dist.all_reduce(p.grad, group=process_group)
    fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


SPECS: List[HookSpec] = [
    HookSpec(name="bad_reduces_grads_returns_bucket", api="ddp", hook=bad_reduces_grads_returns_bucket,
             state=process_group_state,
             description="reduces p.grad, returns the unreduced bucket: right with gradient_as_bucket_view only"),
]
