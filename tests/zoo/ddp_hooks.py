"""A zoo of DDP gradient communication hooks: known-good and known-bad.

The meta-tests (``tests/meta_zoos.py``'s ``DDP``: the shared ones in ``tests/test_meta.py``, the
DDP-only ones in ``tests/test_meta_ddp.py``) run the DDP checks over these hooks. Each
known-good hook must pass every case; each known-bad hook must be caught by the checks
named in ``EXPECTED_CATCH`` (which also says why no weaker check can).

What "good" means is fixed by DDP itself (``torch/csrc/distributed/c10d/reducer.cpp``):
with no hook, the reducer multiplies each gradient by ``1 / world_size`` as it copies it
into the bucket (``at::mul_out(bucket_view, grad, wrapped_scalar_tensor(1. / div_factor))``)
and SUM-all-reduces the bucket. With a hook registered it copies the gradients in
unscaled, calls ``hook(state, bucket)`` and copies the future's value back into the
gradients. A full-precision hook that reproduces DDP bit for bit therefore multiplies by
the reciprocal, then SUM-reduces; dividing by the world size instead (what PyTorch's
``allreduce_hook`` does) is 1 ULP off at world sizes that are not powers of two.

DDP's ``register_comm_hook`` reads the hook's ``__name__`` and ``__qualname__`` and looks
its second parameter up by the name ``bucket``: a callable object must carry both names,
and every hook here calls its second parameter ``bucket``.

Only ``torch`` and ``torch.distributed`` are imported at module level: the zoo is imported
by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from conformance.spec import HookSpec, LossyContract
from tests.zoo.plain_hooks import bad_saturates_inf_off_rank0, bad_sum_then_divide, process_group_state
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "no_state", "process_group_state"]


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


# ---------------------------------------------------------------------------
# Known-bad hooks
# ---------------------------------------------------------------------------


def bad_sum_no_average(process_group, bucket):
    """SUM all-reduce with no division: every gradient is world_size times the mean."""
    return dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future().then(
        lambda f: f.value()[0])


def bad_wrong_dtype(process_group, bucket):
    """Averages correctly, then hands back the result as float16 (DDP silently casts it back)."""
    return _mean_allreduce(process_group, bucket.buffer()).then(lambda f: f.value().to(torch.float16))


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


def bad_returns_list(process_group, bucket):
    """Returns the collective's own future, whose value is a list holding the tensor."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future()


def bad_returns_none(process_group, bucket):
    """Reduces in place and returns nothing (DDP would crash the process on it)."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    dist.all_reduce(buffer, group=process_group)
    return None


def bad_returns_tensor(process_group, bucket):
    """Averages right, then returns the tensor itself instead of a Future holding it (DDP raises
    "must return a torch.futures.Future object, but got torch.Tensor")."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    dist.all_reduce(buffer, group=process_group)
    return buffer


def bad_wrong_shape(process_group, bucket):
    """Hands back a copy of the average without its last element."""
    return _mean_allreduce(process_group, bucket.buffer()).then(lambda f: f.value()[:-1].clone())


def bad_padded_future(process_group, bucket):
    """Pads the bucket to a multiple of the world size (as a reduce-scatter based hook must) and returns
    the padded average: right values, but a future longer than the bucket wherever its length does not
    divide evenly. DDP quietly reads the leading elements."""
    buffer = bucket.buffer()
    pad = (-buffer.numel()) % process_group.size()
    padded = torch.cat([buffer, buffer.new_zeros(pad)]) if pad else buffer.clone()
    return _mean_allreduce(process_group, padded)


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


def bad_param_not_named_bucket(process_group, grads):
    """Correct averaging, but DDP's register_comm_hook looks the parameter up by the name ``bucket``."""
    return _mean_allreduce(process_group, grads.buffer())


def bad_lossy_undeclared(process_group, bucket):
    """An 8-bit quantizing round trip (one scale per bucket) that claims full precision (no ``lossy``
    contract): no exact cause explains it, so the failure offers the LossyContract hint."""
    buffer = bucket.buffer()
    scale = buffer.abs().max().clamp(min=1e-30) / 127
    low = (buffer / scale).round_().clamp_(-127, 127).mul_(scale).div_(process_group.size())

    def back(fut: Any) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(back)


def bad_bf16_undeclared(process_group, bucket):
    """A bfloat16 round trip that claims full precision: an exact cause ("reduced in bfloat16") explains it,
    so the failure says so and offers no LossyContract (claiming reduce_dtype=bfloat16 is the fix)."""
    return _round_trip_allreduce(process_group, bucket, torch.bfloat16)


def bad_lossy_exceeds_bound(process_group, bucket):
    """A bfloat16 round trip (relative error ~2e-3) declared with rel_error_bound=1e-5."""
    return _round_trip_allreduce(process_group, bucket, torch.bfloat16)


def bad_lossy_nan(process_group, bucket):
    """An fp16 round trip, declared lossy, that writes NaN into the first element of every bucket."""
    def poison(f: Any) -> torch.Tensor:
        value = f.value()
        value[0] = float("nan")
        return value

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(poison)


def bad_lossy_rank_dependent(process_group, bucket):
    """Declared lossy; adds noise proportional to the rank, so ranks disagree after the reduction."""
    rank = process_group.rank()

    def noise(f: Any) -> torch.Tensor:
        return f.value().add_(1e-4 * rank)

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(noise)


_CALLS = [0]


def bad_lossy_nondeterministic(process_group, bucket):
    """Declared deterministic, but perturbs each result by a process-wide call counter: identical on
    every rank within a run, different in a second run from the same seed."""
    _CALLS[0] += 1
    tick = _CALLS[0]

    def perturb(f: Any) -> torch.Tensor:
        return f.value().add_(1e-6 * tick)

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(perturb)


def bad_lossy_diverges(process_group, bucket):
    """Declared lossy with a loose per-step bound, but keeps only the gradients' sign (scaled by
    the mean magnitude), so training drifts from the exact run by more than the declared loss margin."""
    buffer = bucket.buffer()

    def sign_compress(f: Any) -> torch.Tensor:
        mean = f.value()
        return buffer.copy_(mean.sign() * mean.abs().mean())

    return _mean_allreduce(process_group, buffer.clone()).then(sign_compress)


#: A contract that a fp16 round trip keeps with room to spare (fp16 relative error ~5e-4).
GENEROUS_FP16 = LossyContract(rel_error_bound=1e-2, deterministic=True, loss_margin=0.05, loss_steps=10)
_LOSSY_FINE = LossyContract(rel_error_bound=1e-2, deterministic=True, loss_margin=0.05, loss_steps=4)

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

KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_sum_no_average", api="ddp", hook=bad_sum_no_average, state=process_group_state),
    HookSpec(name="bad_wrong_dtype", api="ddp", hook=bad_wrong_dtype, state=process_group_state),
    HookSpec(name="bad_stale_second_step", api="ddp", hook=bad_stale_second_step, state=StaleState),
    HookSpec(name="bad_divides_by_world_size", api="ddp", hook=bad_divides_by_world_size,
             state=process_group_state),
    HookSpec(name="bad_returns_list", api="ddp", hook=bad_returns_list, state=process_group_state),
    HookSpec(name="bad_averages_param_grads", api="ddp", hook=bad_averages_param_grads, state=process_group_state),
    HookSpec(name="bad_sum_then_divide", api="ddp", hook=bad_sum_then_divide, state=process_group_state),
    HookSpec(name="bad_returns_none", api="ddp", hook=bad_returns_none, state=process_group_state),
    HookSpec(name="bad_returns_tensor", api="ddp", hook=bad_returns_tensor, state=process_group_state),
    HookSpec(name="bad_rank_order_mean", api="ddp", hook=bad_rank_order_mean, state=process_group_state),
    HookSpec(name="bad_ring_no_average_tail", api="ddp", hook=bad_ring_no_average_tail, state=process_group_state),
    HookSpec(name="bad_rs_ag_tail_unreduced", api="ddp", hook=bad_rs_ag_tail_unreduced, state=process_group_state),
    HookSpec(name="bad_world_size_divisor", api="ddp", hook=bad_world_size_divisor, state=process_group_state),
    HookSpec(name="bad_wrong_shape", api="ddp", hook=bad_wrong_shape, state=process_group_state),
    HookSpec(name="bad_padded_future", api="ddp", hook=bad_padded_future, state=process_group_state),
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
    HookSpec(name="bad_param_not_named_bucket", api="ddp", hook=bad_param_not_named_bucket,
             state=process_group_state),
    HookSpec(name="bad_noop_hook", api="ddp", hook=noop_hook, state=no_state,
             description="PyTorch's debugging_hooks.noop_hook: returns each rank's own bucket"),
    HookSpec(name="bad_lossy_undeclared", api="ddp", hook=bad_lossy_undeclared, state=process_group_state),
    HookSpec(name="bad_bf16_undeclared", api="ddp", hook=bad_bf16_undeclared, state=process_group_state),
    HookSpec(name="bad_lossy_exceeds_bound", api="ddp", hook=bad_lossy_exceeds_bound, state=process_group_state,
             lossy=LossyContract(rel_error_bound=1e-5, loss_margin=0.05, loss_steps=4)),
    HookSpec(name="bad_lossy_nan", api="ddp", hook=bad_lossy_nan, state=process_group_state, lossy=_LOSSY_FINE),
    HookSpec(name="bad_lossy_rank_dependent", api="ddp", hook=bad_lossy_rank_dependent,
             state=process_group_state, lossy=LossyContract(rel_error_bound=None, loss_margin=None)),
    HookSpec(name="bad_lossy_nondeterministic", api="ddp", hook=bad_lossy_nondeterministic,
             state=process_group_state, lossy=LossyContract(rel_error_bound=None, deterministic=True)),
    HookSpec(name="bad_lossy_diverges", api="ddp", hook=bad_lossy_diverges, state=process_group_state,
             lossy=LossyContract(rel_error_bound=None, loss_margin=0.01, loss_steps=10)),
]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: For each known-bad hook: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_sum_no_average": "averaging: every element is sum(0..ws-1), ws times the mean; parity fails too",
    "bad_wrong_dtype": (
        "future_contract: the future holds float16 for a float32 bucket; parity fails too, through the "
        "fp16 rounding DDP's silent cast back keeps"
    ),
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
    "bad_returns_list": (
        "future_contract: the future holds [tensor]; every check reports that instead of DDP's "
        "'Unable to cast' error"
    ),
    "bad_returns_none": (
        "future_contract: not a Future, which would crash the rank process inside DDP; every training "
        "check reports the violation instead"
    ),
    "bad_returns_tensor": (
        "future_contract: a Tensor, not a Future; the finding says DDP raises a RuntimeError on it (only None "
        "crashes the process), and no failure offers the LossyContract hint: a broken contract is a bug"
    ),
    "bad_wrong_shape": (
        "future_contract: one element short; DDP reads the missing element from the storage behind the "
        "view without complaint, so parity alone could pass it"
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
    "bad_padded_future": (
        "future_contract and parity: a bucket whose length does not divide by the world size comes back "
        "padded; the values DDP reads are right, so only the recorded contract shows it"
    ),
    "bad_param_not_named_bucket": (
        "future_contract: DistributedDataParallel.register_comm_hook raises KeyError('bucket') for the "
        "bare hook (the other checks go through the suite's recorder and pass)"
    ),
    "bad_noop_hook": (
        "averaging, in plain words ('the hook never communicated', from the diagnosis), parity and rank_consistency: PyTorch's "
        "noop_hook hands every rank its own gradient back"
    ),
    "bad_lossy_undeclared": "parity, with the hint on how to declare a LossyContract (no named cause explains it)",
    "bad_bf16_undeclared": (
        "parity, diagnosed as reduced in bfloat16 where it claims no reduce dtype, and no LossyContract hint"
    ),
    "bad_lossy_exceeds_bound": "lossy_error: bf16 error ~2e-3 against a declared 1e-5, with the observed figure",
    "bad_lossy_nan": "lossy_error: NaN where the exact mean is finite",
    "bad_lossy_rank_dependent": "rank_consistency: ranks differ by 1e-4 * rank after the reduction",
    "bad_lossy_nondeterministic": "lossy_determinism: the second run from the same seed differs",
    "bad_lossy_diverges": "lossy_loss: sign compression trains away from the exact run",
}
