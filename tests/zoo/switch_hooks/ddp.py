"""The switch zoo's DDP hooks, ``hook(state, bucket)``: a path taken only where two switches hold at once, a warm-up
and a large bucket, or several nodes and a large bucket (``tests/zoo/switch_hooks/__init__.py`` says what the zoo
holds). The line that decides each one's other path ends in ``# switch``.

No ``from __future__ import annotations``: DDP compares a hook's annotations with ``dist.GradBucket`` as objects.
"""

import os
from typing import Any, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _ddp_mean, _done, _Staging, topology

#: Steps of plain DDP averaging before the other path may start (PowerSGD's ``start_powerSGD_iter``).
DDP_WARMUP_STEPS = 64
#: Buckets of this many elements and more take the other path (2 MiB of float32).
DDP_LARGE_NUMEL = 2 ** 19


class DdpSwitchState:
    """The process group, a step counter advanced after the last bucket (PowerSGD's ``maybe_increase_iter``), and
    persistent staging buffers, one per bucket."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.iter = 0
        self.staging = _Staging()

    def maybe_increase_iter(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1


def _bf16_mean(process_group: Any, buffer: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    """bf16_compress_hook's arithmetic: the bucket cast to bfloat16, divided, SUM-all-reduced, cast back."""
    low = buffer.to(torch.bfloat16).div_(process_group.size())
    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(
        lambda f: buffer.copy_(f.value()[0]))


def _staged_mean(state: DdpSwitchState, bucket: Any) -> "torch.futures.Future[torch.Tensor]":
    """DDP's arithmetic through a persistent staging buffer: copied in, ``* (1/N)``, SUM, copied back."""
    buffer = bucket.buffer()
    staged = state.staging.get(bucket.index(), buffer).copy_(buffer)
    return _ddp_mean(state.process_group, staged).then(lambda f: buffer.copy_(f.value()))


# -- warm-up x size ------------------------------------------------------------------------------------------------


def bad_ddp_warm_large_bf16(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Once warmed up (64 steps) large buckets (2**19 elements and more) are bandwidth-bound, so they go bfloat16
    on the wire; every other bucket, and every bucket before step 64, gets DDP's averaging. Claims full
    precision."""
    buffer = bucket.buffer()
    if state.iter >= DDP_WARMUP_STEPS and buffer.numel() >= DDP_LARGE_NUMEL:  # switch
        fut = _bf16_mean(state.process_group, buffer)
    else:
        fut = _ddp_mean(state.process_group, buffer)
    state.maybe_increase_iter(bucket)
    return fut


def good_ddp_warm_large_staged(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Once warmed up (64 steps), large buckets (2**19 elements and more) go through a persistent staging buffer;
    DDP's arithmetic on every path."""
    if state.iter >= DDP_WARMUP_STEPS:
        if bucket.buffer().numel() >= DDP_LARGE_NUMEL:  # switch
            fut = _staged_mean(state, bucket)
        else:
            fut = _ddp_mean(state.process_group, bucket.buffer())
    else:
        fut = _ddp_mean(state.process_group, bucket.buffer())
    state.maybe_increase_iter(bucket)
    return fut


# -- nodes x size --------------------------------------------------------------------------------------------------


def bad_ddp_nodes_large_local_divisor(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Across nodes, large buckets (2**19 elements and more) take the "hierarchical" path written for one node:
    ``x * (1/LOCAL_WORLD_SIZE)``, then SUM over the process group; gradients ``nodes`` times the mean. Every
    other bucket, and every bucket on one node, gets DDP's averaging."""
    buffer = bucket.buffer()
    local_world_size, nodes, _, _ = topology(dist.get_world_size())
    if nodes > 1 and buffer.numel() >= DDP_LARGE_NUMEL:  # switch
        buffer.mul_(1.0 / local_world_size)
        return dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future().then(
            lambda f: f.value()[0])
    return _ddp_mean(state.process_group, buffer)


def good_ddp_nodes_large_staged(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Across nodes, large buckets (2**19 elements and more) go through a persistent staging buffer and an async
    all-reduce chained into the future; DDP's arithmetic on every path."""
    _, nodes, _, _ = topology(dist.get_world_size())
    if nodes > 1 and bucket.buffer().numel() >= DDP_LARGE_NUMEL:  # switch
        return _staged_mean(state, bucket)
    return _ddp_mean(state.process_group, bucket.buffer())


def _ddp(name: str, hook: Any, description: str, **kwargs: Any) -> HookSpec:
    return HookSpec(name=name, api="ddp", hook=hook, state=DdpSwitchState, description=description, **kwargs)


KNOWN_GOOD: List[HookSpec] = [
    _ddp("good_ddp_warm_large_staged", good_ddp_warm_large_staged,
         "after 64 steps, buckets >= 2**19 elements staged: DDP's arithmetic"),
    _ddp("good_ddp_nodes_large_staged", good_ddp_nodes_large_staged,
         "across nodes, buckets >= 2**19 elements staged and async: DDP's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _ddp("bad_ddp_warm_large_bf16", bad_ddp_warm_large_bf16,
         "after 64 steps, buckets >= 2**19 elements in bfloat16, claiming full precision"),
    _ddp("bad_ddp_nodes_large_local_divisor", bad_ddp_nodes_large_local_divisor,
         "across nodes, buckets >= 2**19 elements scaled by 1/LOCAL_WORLD_SIZE"),
]
