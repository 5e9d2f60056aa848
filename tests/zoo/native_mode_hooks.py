"""DDP hooks written for one of DDP's natives (issue 45): ``DistributedDataParallel`` by default multiplies each
gradient by ``1/world_size`` as it fills the bucket; with ``batched_grad_copy=True`` (torch 2.13+) it divides the
flat bucket by the world size. At 3 ranks the two differ in the last bit, so a hook is exact for one of them.

* ``good_reciprocal_default_native``: ``x (1/N)``, SUM: DDP's default native; its spec names no mode, so its
  batched-copy cases are skipped with the reason.
* ``good_divides_batched_native``: ``/ N``, SUM (``allreduce_hook``'s arithmetic), meant for the batched copy
  (``native_modes=("batched_grad_copy",)``): its cases against the default native are skipped with the reason.
* ``bad_reciprocal_in_batched_native`` and ``bad_divides_in_default_native``: the same two hooks claiming both
  natives; each is caught at 3 ranks in the mode it does not match, its cause named by that mode's arithmetic.

Only ``torch`` is imported (and the suite's ``HookSpec``): the zoo is imported by the controller and every rank.
"""

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec


def process_group_state(process_group: Any) -> Any:
    return process_group


def reciprocal_then_sum(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """``bucket x (1/N)``, then a SUM all-reduce: default DDP's arithmetic."""
    buffer = bucket.buffer().mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def divide_then_sum(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """``bucket / N``, then a SUM all-reduce: DDP's with ``batched_grad_copy=True`` (and ``allreduce_hook``'s)."""
    buffer = bucket.buffer().div_(process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


BOTH = ("default", "batched_grad_copy")

KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_reciprocal_default_native", api="ddp", hook=reciprocal_then_sum, state=process_group_state,
             description="x 1/world_size, SUM: DDP's default native"),
    HookSpec(name="good_divides_batched_native", api="ddp", hook=divide_then_sum, state=process_group_state,
             native_modes=("batched_grad_copy",), description="/ world_size, SUM: DDP(batched_grad_copy=True)"),
]
KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_reciprocal_in_batched_native", api="ddp", hook=reciprocal_then_sum, state=process_group_state,
             native_modes=BOTH, description="x 1/world_size, SUM, claiming the batched copy's native too"),
    HookSpec(name="bad_divides_in_default_native", api="ddp", hook=divide_then_sum, state=process_group_state,
             native_modes=BOTH, description="/ world_size, SUM, claiming DDP's default native too"),
]
ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

EXPECTED_CATCH: Dict[str, str] = {
    "bad_reciprocal_in_batched_native": ("parity in the batched_grad_copy config at 3 ranks: x * (1/3) where DDP "
                                         "with batched_grad_copy=True divides by 3 (the default configs pass)"),
    "bad_divides_in_default_native": ("parity in the default config at 3 ranks: x / 3 where default DDP multiplies "
                                      "by 1/3 (the batched_grad_copy config passes)"),
}
