"""The DDP zoo's known-bad hooks whose reduction is wrong: no average, the wrong divisor or group, a stale or
local result, a rounding order unlike DDP's, an unreduced tail, hard values lost in float16; each with its
``HookSpec`` and what must catch it (``EXPECTED_CATCH``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from conformance.spec import HookSpec
from tests.zoo.ddp_hooks.good import no_state
from tests.zoo.plain_hooks import bad_saturates_inf_off_rank0, bad_sum_then_divide, process_group_state
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce


def bad_sum_no_average(process_group, bucket):
    """SUM all-reduce with no division: every gradient is world_size times the mean."""
    return dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future().then(
        lambda f: f.value()[0])


class StaleState:
    """The process group plus a cache of the first result per bucket (for ``bad_stale_second_step``)."""

    def __init__(self, process_group: Any):
        self.process_group = process_group
        self.first: Dict[int, torch.Tensor] = {}


def bad_stale_second_step(state, bucket):
    """Correct on a bucket's first call; from then on completes the future with that first result."""
    buffer = bucket.buffer()
    cached = state.first.get(bucket.index())
    if cached is not None and cached.shape == buffer.shape:
        fut: Any = torch.futures.Future()
        fut.set_result(cached.clone())
        return fut

    def remember(f: Any) -> torch.Tensor:
        value = f.value()
        state.first[bucket.index()] = value.clone()
        return value

    return _mean_allreduce(state.process_group, buffer).then(remember)


def bad_divides_by_world_size(process_group, bucket):
    """Divides by the world size instead of multiplying by its reciprocal (PyTorch's allreduce_hook)."""
    buffer = bucket.buffer()
    buffer.div_(process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def bad_averages_param_grads(process_group, bucket):
    """Averages each parameter's ``p.grad`` in place, then returns the bucket's buffer, unreduced.

    Seen in a public climate-model codebase. It communicates, but DDP copies
    the future's value (the unreduced bucket) over the gradients afterwards;
    only with ``gradient_as_bucket_view=True`` is ``p.grad`` a view of the
    bucket, so only the ``bucket_view`` config trains right.
    """
    for p in bucket.parameters():
        if p.grad is not None:
            p.grad.mul_(1.0 / process_group.size())
            dist.all_reduce(p.grad, group=process_group)
    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def bad_world_size_divisor(process_group, bucket):
    """Multiplies by 1/dist.get_world_size(), the default group's size, then SUMs over its process group:
    DDP's own arithmetic wherever the process group is WORLD; half the average on a subgroup of half the
    ranks."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(
        lambda f: f.value()[0])


def bad_rank_order_mean(process_group, bucket):
    """A "deterministic" average: all-gathers every rank's bucket, sums in rank order, then divides by the
    world size. Exact at 2 ranks; at 3, (a + b + c) / 3 in rank order rounds unlike DDP's 1/3 before the
    SUM."""
    buffer = bucket.buffer()
    gathered = [torch.empty_like(buffer) for _ in range(process_group.size())]
    dist.all_gather(gathered, buffer, group=process_group)
    total = gathered[0].clone()
    for other in gathered[1:]:
        total += other
    buffer.copy_(total.div_(process_group.size()))
    fut: Any = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _done(tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    fut: Any = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def bad_ring_no_average_tail(process_group, bucket):
    """A ring all-reduce written with isend/irecv: a reduce-scatter pass, then an all-gather pass, over the
    first numel - numel % world_size elements. It never divides, and never exchanges the last
    numel % world_size elements, which keep the local gradient: two causes at once."""
    buffer = bucket.buffer()
    ws, me = process_group.size(), dist.get_rank(process_group)
    n = buffer.numel() - buffer.numel() % ws
    if ws == 1 or n == 0:
        return _done(buffer)
    chunks = list(buffer[:n].view(ws, -1))
    right = dist.get_global_rank(process_group, (me + 1) % ws)
    left = dist.get_global_rank(process_group, (me - 1) % ws)
    incoming = torch.empty_like(chunks[0])

    def exchange(send: torch.Tensor) -> None:
        for req in (dist.isend(send.contiguous(), right, group=process_group),
                    dist.irecv(incoming, left, group=process_group)):
            req.wait()

    for s in range(ws - 1):  # chunk c is summed in ring order: rank c first, then c + 1, ...
        exchange(chunks[(me - s) % ws])
        chunks[(me - s - 1) % ws] += incoming
    for s in range(ws - 1):
        exchange(chunks[(me + 1 - s) % ws])
        chunks[(me - s) % ws].copy_(incoming)
    return _done(buffer)


def bad_rs_ag_tail_unreduced(process_group, bucket):
    """Scales by 1/world_size as DDP does, then a reduce-scatter and an all-gather over the first
    numel - numel % world_size elements; the last numel % world_size keep the scaled local gradient."""
    buffer = bucket.buffer()
    ws = process_group.size()
    buffer.mul_(1.0 / ws)
    n = buffer.numel() - buffer.numel() % ws
    if n:
        shard = torch.empty(n // ws, dtype=buffer.dtype)
        dist.reduce_scatter_tensor(shard, buffer[:n].clone(), group=process_group)
        dist.all_gather_into_tensor(buffer[:n], shard, group=process_group)
    return _done(buffer)


def bad_nan_to_zero(process_group, bucket):
    """DDP's averaging, then NaN and +/-Inf replaced by zero (a "sanitizing" hook that hides a
    diverging step); equal to DDP on every finite input."""
    return _mean_allreduce(process_group, bucket.buffer()).then(
        lambda f: torch.nan_to_num_(f.value(), nan=0.0, posinf=0.0, neginf=0.0))


def bad_default_group(process_group, bucket):
    """DDP's averaging over the default group instead of the state's process group (the group argument
    forgotten): right wherever DDP runs on WORLD, which every case but the subgroup one does."""
    tensor = bucket.buffer().mul_(1.0 / process_group.size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def bad_fp16_divide_after(process_group, bucket):
    """Claims float16: casts to float16, SUM all-reduce, then divides by the world size, where
    fp16_compress_hook divides first. Bitwise equal to it on ordinary values at 2 ranks (a
    division by 2 is exact), but the undivided float16 sum overflows near 65504."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)

    def back(f: Any) -> torch.Tensor:
        buffer.copy_(f.value()[0].div_(process_group.size()))
        return buffer

    return dist.all_reduce(half, group=process_group, async_op=True).get_future().then(back)


def bad_fp16_cast_back_then_divide(process_group, bucket):
    """Claims float16: casts to float16, SUM all-reduce, casts the sum back to the bucket's float32, then
    divides there. Its float32 division rounds unlike fp16_compress_hook's float16 one at 3 ranks, and the
    undivided float16 sum overflows near 65504."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)

    def back(f: Any) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer.div_(process_group.size())

    return dist.all_reduce(half, group=process_group, async_op=True).get_future().then(back)


#: float16's smallest normal: a bucket below it on every element loses bits to subnormals when cast.
_FP16_TINY = 2.0 ** -14
#: The power of two a tiny bucket is multiplied by before the cast, and divided by after.
_FP16_RESCUE = 2.0 ** 20


def bad_fp16_rescues_tiny_buckets(process_group, bucket):
    """Claims float16: fp16_compress_hook's arithmetic, but a rank whose own bucket lies wholly below float16's
    normal range (and is not all zeros) multiplies it by 2**20 before the cast (so it keeps its bits) and divides the result by 2**20.

    The decision is each rank's own: where the ranks' magnitudes are alike they all decide alike (the
    models' gradients and the packed hard values, which put overflow-sized values in every bucket), and
    the power of two is exact. Where one rank's gradients are 10**6 times smaller than another's, that
    rank alone rescales, and the SUM mixes scales."""
    buffer = bucket.buffer()
    largest = float(buffer.abs().max())
    rescue = 0.0 < largest < _FP16_TINY  # an all-zero bucket needs no rescue
    low = (buffer * _FP16_RESCUE if rescue else buffer).to(torch.float16).div_(process_group.size())

    def back(fut: Any) -> torch.Tensor:
        out = fut.value()[0]
        return buffer.copy_(out.float().div_(_FP16_RESCUE) if rescue else out)

    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(back)


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_sum_no_average", api="ddp", hook=bad_sum_no_average, state=process_group_state),
    HookSpec(name="bad_stale_second_step", api="ddp", hook=bad_stale_second_step, state=StaleState),
    HookSpec(name="bad_divides_by_world_size", api="ddp", hook=bad_divides_by_world_size,
             state=process_group_state),
    HookSpec(name="bad_averages_param_grads", api="ddp", hook=bad_averages_param_grads, state=process_group_state),
    HookSpec(name="bad_sum_then_divide", api="ddp", hook=bad_sum_then_divide, state=process_group_state),
    HookSpec(name="bad_rank_order_mean", api="ddp", hook=bad_rank_order_mean, state=process_group_state),
    HookSpec(name="bad_ring_no_average_tail", api="ddp", hook=bad_ring_no_average_tail, state=process_group_state),
    HookSpec(name="bad_rs_ag_tail_unreduced", api="ddp", hook=bad_rs_ag_tail_unreduced, state=process_group_state),
    HookSpec(name="bad_world_size_divisor", api="ddp", hook=bad_world_size_divisor, state=process_group_state),
    HookSpec(name="bad_nan_to_zero", api="ddp", hook=bad_nan_to_zero, state=process_group_state),
    HookSpec(name="bad_default_group", api="ddp", hook=bad_default_group, state=process_group_state),
    HookSpec(name="bad_saturates_inf_off_rank0", api="ddp", hook=bad_saturates_inf_off_rank0,
             state=process_group_state),
    HookSpec(name="bad_fp16_divide_after", api="ddp", hook=bad_fp16_divide_after, state=process_group_state,
             reduce_dtype=torch.float16),
    HookSpec(name="bad_fp16_cast_back_then_divide", api="ddp", hook=bad_fp16_cast_back_then_divide,
             state=process_group_state, reduce_dtype=torch.float16),
    HookSpec(name="bad_fp16_rescues_tiny_buckets", api="ddp", hook=bad_fp16_rescues_tiny_buckets,
             state=process_group_state, reduce_dtype=torch.float16),
    HookSpec(name="bad_noop_hook", api="ddp", hook=noop_hook, state=no_state,
             description="PyTorch's debugging_hooks.noop_hook: returns each rank's own bucket"),
]

#: For each known-bad hook here: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_sum_no_average": "averaging: every element is sum(0..ws-1), ws times the mean; parity fails too",
    "bad_stale_second_step": (
        "parity: step 0 is exact, from step 1 on the cached step-0 result differs; averaging cannot "
        "see it because the analytic model's gradient is the same at every step"
    ),
    "bad_divides_by_world_size": (
        "parity at world size 3 only: x / 3 and x * (1/3) differ in the last bit; at 2 ranks both are exact"
    ),
    "bad_averages_param_grads": (
        "averaging and parity in every config but bucket_view: DDP copies the unreduced bucket the future "
        "holds over the gradients the hook averaged; the diagnosis says it communicated but returned the "
        "local gradient"
    ),
    "bad_sum_then_divide": (
        "parity at world size 3 only: (a + b + c) / 3 rounds unlike DDP's a/3 + b/3 + c/3 computed as x * (1/3); "
        "the diagnosis names the rounding order"
    ),
    "bad_rank_order_mean": (
        "parity at world size 3 only; the diagnosis names a sum in rank order, then a divide, where DDP "
        "multiplies by 1/3 before the SUM (today: no known cause, and the LossyContract hint)"
    ),
    "bad_ring_no_average_tail": (
        "averaging and parity: no averaging on the ring's body, and a tail of numel % world_size elements "
        "left with the local gradient; the diagnosis names both, with the index ranges"
    ),
    "bad_rs_ag_tail_unreduced": (
        "parity wherever a bucket's length is not a multiple of the world size: the tail holds the local "
        "gradient already scaled by 1/world_size; the diagnosis names it"
    ),
    "bad_world_size_divisor": (
        "parity in the subgroup config only; the diagnosis names the divisor's source, the default group's "
        "size, and says to ask the process group (today it says 'averaged twice')"
    ),
    "bad_nan_to_zero": "hard_inputs: NaN on one rank and +Inf against -Inf come back as zeros",
    "bad_default_group": "parity in the subgroup config only: every other case trains on WORLD",
    "bad_saturates_inf_off_rank0": (
        "hard_inputs, generated examples only: +Inf on a rank other than 0 comes back finite; the failure "
        "is shrunk to that one element"
    ),
    "bad_fp16_divide_after": (
        "hard_inputs: near 65504 the undivided float16 sum overflows to inf where fp16_compress_hook's "
        "divided one stays finite; on the models' ordinary values it passes at 2 ranks"
    ),
    "bad_fp16_cast_back_then_divide": (
        "parity at 3 ranks and hard_inputs (the float16 sum overflows); parity and hard inputs must tell the "
        "same story: a float16 SUM, cast back, then divided by 3 in float32"
    ),
    "bad_fp16_rescues_tiny_buckets": (
        "hard_inputs, the per-rank magnitudes example: a rank whose gradients are 10**6 times smaller than "
        "rank 0's rescales its own bucket by 2**20 alone, so the float16 SUM mixes scales; the models' "
        "gradients and the packed hard values never show it"
    ),
    "bad_noop_hook": (
        "averaging, in plain words ('the hook never communicated', from the diagnosis), parity and rank_consistency: PyTorch's "
        "noop_hook hands every rank its own gradient back"
    ),
}
