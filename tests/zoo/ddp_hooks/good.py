"""The DDP zoo's known-good hooks, each with its ``HookSpec``: DDP's own averaging as a function, a callable object
and through a state object, and the float16 and bfloat16 round trips of PyTorch's compress hooks, claimed
(``reduce_dtype``) or declared lossy. ``tests/zoo/ddp_hooks/__init__.py`` says what "good" means for DDP.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec, LossyContract
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce
from tests.zoo.plain_hooks import process_group_state


def no_state(process_group: Any) -> None:
    """``noop_hook`` takes no state."""
    return None


def _round_trip_allreduce(process_group: Any, bucket: Any, dtype: torch.dtype) -> "torch.futures.Future[torch.Tensor]":
    """Cast to ``dtype``, divide by the world size, SUM all-reduce, copy back into the bucket (its dtype)."""
    buffer = bucket.buffer()
    low = buffer.to(dtype).div_(process_group.size())

    def back(fut: Any) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(back)


# ---------------------------------------------------------------------------
# Known-good hooks
# ---------------------------------------------------------------------------


def good_mean_allreduce(process_group, bucket):
    """Scale by 1/world_size and SUM all-reduce: bit for bit what DDP does with no hook."""
    return _mean_allreduce(process_group, bucket.buffer())


class MeanAllreduceHook:
    """The same averaging as a callable object with its own state (it counts the buckets it reduced).

    DDP's ``register_comm_hook`` reads ``hook.__name__`` and ``hook.__qualname__``,
    which instances do not have, so the object sets both.
    """

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = type(self).__qualname__
        self.calls = 0

    def __call__(self, process_group, bucket):
        self.calls += 1
        return _mean_allreduce(process_group, bucket.buffer())


class CountingState:
    """A state object carrying the process group, as real hooks' states do."""

    def __init__(self, process_group: Any):
        self.process_group = process_group
        self.buckets = 0


def good_state_object(state, bucket):
    """Averaging through a state object (``state.process_group``), not a bare process group."""
    state.buckets += 1
    return _mean_allreduce(state.process_group, bucket.buffer())


def good_fp16_claim(process_group, bucket):
    """Claims ``reduce_dtype=float16``: fp16_compress_hook's arithmetic, handing back the bucket's dtype."""
    return _round_trip_allreduce(process_group, bucket, torch.float16)


def good_bf16_claim(process_group, bucket):
    """Claims ``reduce_dtype=bfloat16``: bf16_compress_hook's arithmetic under a name DDP does not refuse.

    DDP refuses hooks *named* bf16_compress_hook on a torch built without CUDA;
    this correct hook must pass everywhere, and must never be blamed for the
    suite's own reference being refused.
    """
    return _round_trip_allreduce(process_group, bucket, torch.bfloat16)


def good_fp16_lossy_declared(process_group, bucket):
    """An fp16 round trip that claims nothing exact, only a generous lossy contract."""
    return _round_trip_allreduce(process_group, bucket, torch.float16)


#: A contract that a fp16 round trip keeps with room to spare (fp16 relative error ~5e-4).
GENEROUS_FP16 = LossyContract(rel_error_bound=1e-2, deterministic=True, loss_margin=0.05, loss_steps=10)

KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_mean_allreduce", api="ddp", hook=good_mean_allreduce, state=process_group_state,
             description="mul by 1/world_size, SUM all-reduce (a function)"),
    HookSpec(name="good_mean_allreduce_object", api="ddp", hook=MeanAllreduceHook(), state=process_group_state,
             description="the same as a callable object"),
    HookSpec(name="good_state_object", api="ddp", hook=good_state_object, state=CountingState,
             description="the same through a state object"),
    HookSpec(name="good_fp16_claim", api="ddp", hook=good_fp16_claim, state=process_group_state,
             reduce_dtype=torch.float16, description="fp16_compress_hook's arithmetic, result in the bucket dtype"),
    HookSpec(name="good_bf16_claim", api="ddp", hook=good_bf16_claim, state=process_group_state,
             reduce_dtype=torch.bfloat16),
    HookSpec(name="good_fp16_lossy_declared", api="ddp", hook=good_fp16_lossy_declared, state=process_group_state,
             lossy=GENEROUS_FP16, description="fp16 round trip declared lossy with a generous bound"),
]
