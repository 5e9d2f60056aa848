"""The reach zoo's DDP hooks, ``hook(state, bucket) -> Future[Tensor]``, by axis (size, horizon, topology), with
their ``HookSpec`` s (``tests/zoo/reach_hooks/__init__.py`` says what each axis means and holds ``REACH``).

DDP hooks are annotated ``bucket: dist.GradBucket`` and ``-> torch.futures.Future[torch.Tensor]`` (so the
suite knows they take a bucket and plans no compiled-autograd case for them). The annotations must be the
objects: DDP's ``register_comm_hook`` refuses a hook whose annotations are strings ("bucket annotation should
be dist.GradBucket"), which ``from __future__ import annotations`` would make them, so this module does not
import it.
"""

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _ddp_mean, _done, _Staging, _two_level_groups, topology

#: 1 MiB of float32: the chunk of bad_ddp_chunked_drops_tail.
DDP_CHUNK_NUMEL = 2 ** 18
#: 8 MiB of float32: buckets at or above it go bfloat16 in bad_ddp_large_bucket_bf16.
DDP_BF16_NUMEL = 2 ** 21
#: 1 MiB of float32: buckets at or above it are staged in good_ddp_staged_large.
DDP_STAGE_NUMEL = 2 ** 18


def process_group_state(process_group: Any) -> Any:
    return process_group


class DdpStepState:
    """The process group, a step counter advanced after the last bucket (PowerSGD's ``maybe_increase_iter``), and
    persistent staging buffers."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.iter = 0
        self.staging = _Staging()

    def maybe_increase_iter(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1


# -- size --------------------------------------------------------------------


def bad_ddp_chunked_drops_tail(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Buckets above 1 MiB are all-reduced in 1 MiB chunks (to bound the transport's message size), ``numel //
    CHUNK`` of them: the last partial chunk is never reduced and keeps this rank's gradient, scaled by 1/N."""
    buffer = bucket.buffer()
    if buffer.numel() <= DDP_CHUNK_NUMEL:
        return _ddp_mean(process_group, buffer)
    buffer.mul_(1.0 / process_group.size())
    for i in range(buffer.numel() // DDP_CHUNK_NUMEL):
        dist.all_reduce(buffer[i * DDP_CHUNK_NUMEL:(i + 1) * DDP_CHUNK_NUMEL], group=process_group)
    return _done(buffer)


def bad_ddp_large_bucket_bf16(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Buckets of 8 MiB and more are bandwidth-bound, so they go bfloat16 on the wire (bf16_compress_hook's
    arithmetic); smaller ones DDP's full precision. Claims full precision."""
    buffer = bucket.buffer()
    if buffer.numel() < DDP_BF16_NUMEL:
        return _ddp_mean(process_group, buffer)
    low = buffer.to(torch.bfloat16).div_(process_group.size())
    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(
        lambda f: buffer.copy_(f.value()[0]))


def good_ddp_staged_large(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Buckets of 1 MiB and more are copied into a persistent staging buffer (registered memory), scaled and
    all-reduced there in one call, and copied back: DDP's own arithmetic on both sides of the threshold."""
    buffer = bucket.buffer()
    if buffer.numel() < DDP_STAGE_NUMEL:
        return _ddp_mean(state.process_group, buffer)
    staged = state.staging.get(bucket.index(), buffer).copy_(buffer)
    return _ddp_mean(state.process_group, staged).then(lambda f: buffer.copy_(f.value()))


# -- horizon -------------------------------------------------------------------


class DdpWarmupState(DdpStepState):
    """PowerSGD-style: ``start_iter`` steps of plain all-reduce before the compressed path."""

    def __init__(self, process_group: Any, start_iter: int = 10) -> None:
        super().__init__(process_group)
        self.start_iter = start_iter


def bad_ddp_warmup_fp16(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD-style warm-up: DDP's averaging for ``start_iter`` (10) steps, then float16 compression
    (fp16_compress_hook's arithmetic) from step 10 on, while claiming full precision."""
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        fut = _ddp_mean(state.process_group, buffer)
    else:
        low = buffer.to(torch.float16).div_(state.process_group.size())
        fut = dist.all_reduce(low, group=state.process_group, async_op=True).get_future().then(
            lambda f: buffer.copy_(f.value()[0]))
    state.maybe_increase_iter(bucket)
    return fut


class DdpSkipState(DdpStepState):
    """Communication skipping: every ``skip_every``-th step reuses each bucket's last reduced gradient."""

    def __init__(self, process_group: Any, skip_every: int = 37) -> None:
        super().__init__(process_group)
        self.skip_every = skip_every
        self.last: Dict[int, torch.Tensor] = {}


def bad_ddp_skip_every_k(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communication skipping: every 37th step (the first at step 36) reuses the bucket's last reduced gradient
    instead of all-reducing ("gradients change slowly"); a bucket with no result yet is reduced."""
    buffer = bucket.buffer()
    index = bucket.index()
    last = state.last.get(index)
    if (state.iter + 1) % state.skip_every == 0 and last is not None and last.shape == buffer.shape:
        fut = _done(buffer.copy_(last))
    else:
        def remember(f: Any) -> torch.Tensor:
            state.last[index] = f.value().clone()
            return f.value()

        fut = _ddp_mean(state.process_group, buffer).then(remember)
    state.maybe_increase_iter(bucket)
    return fut


class DdpProbeState(DdpStepState):
    """A periodic gradient-noise probe: every ``probe_every`` steps, how far this rank's gradient is from the mean."""

    def __init__(self, process_group: Any, probe_every: int = 100) -> None:
        super().__init__(process_group)
        self.probe_every = probe_every
        self.noise: List[float] = []


def bad_ddp_noise_probe(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's averaging; every 100 steps (the first at step 100) a gradient-noise probe measures ``|mean - local|``
    in place on the result, to spare a bucket-sized temporary, and adds the local gradient back: ``(m - l) + l``
    is not ``m`` in floating point, so the probe's steps hand DDP a result a few ULPs off."""
    buffer = bucket.buffer()
    probe = state.iter > 0 and state.iter % state.probe_every == 0
    local = buffer.clone() if probe else None
    fut = _ddp_mean(state.process_group, buffer)
    if probe:
        def measure(f: Any) -> torch.Tensor:
            mean = f.value()
            mean.sub_(local)
            state.noise.append(float(mean.norm()))
            return mean.add_(local)

        fut = fut.then(measure)
    state.maybe_increase_iter(bucket)
    return fut


class DdpRankZeroProbeState(DdpStepState):
    """A gradient-norm probe taken on rank 0 only, at steps 40, 104, 168, ... (``probe_at`` mod ``probe_every``)."""

    def __init__(self, process_group: Any, probe_at: int = 40, probe_every: int = 64) -> None:
        super().__init__(process_group)
        self.probe_at = probe_at
        self.probe_every = probe_every
        self.norms: List[float] = []


def bad_ddp_rank0_norm_probe(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's averaging; at step 40 and every 64 steps after, rank 0 alone logs the averaged gradient's norm,
    normalising the result in place and scaling it back (``(m * (1/n)) * n`` is not ``m`` in floating point):
    a difference on one rank only, at a step where the suite's ranks do not check in. The other ranks stay
    native, so a suite whose differing rank stops training while its peers go on leaves them in DDP's next
    all-reduce."""
    probe = (dist.get_rank(state.process_group) == 0 and state.iter >= state.probe_at
             and state.iter % state.probe_every == state.probe_at % state.probe_every)
    fut = _ddp_mean(state.process_group, bucket.buffer())
    if probe:
        def measure(f: Any) -> torch.Tensor:
            mean = f.value()
            norm = float(mean.norm())
            state.norms.append(norm)
            return mean.mul_(1.0 / norm).mul_(norm) if norm > 0 else mean

        fut = fut.then(measure)
    state.maybe_increase_iter(bucket)
    return fut


class DdpReplyTableState:
    """Idempotent delivery: replies kept by (bucket, sequence number), the number ``SEQ_BITS`` wide (a header
    field), so that a resent bucket is answered from the table instead of being reduced twice."""

    SEQ_BITS = 7

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.seq: Dict[int, int] = {}
        self.replies: Dict[Tuple[int, int], torch.Tensor] = {}


def bad_ddp_reply_table_wraps(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Answers a (bucket, 7-bit sequence number) it has seen from its reply table, as for a resent message. The
    table is never evicted, and the number wraps after 128 calls: from step 128 on every bucket is "a resend" of
    the one 128 steps before and gets that step's gradient."""
    buffer = bucket.buffer()
    index = bucket.index()
    seq = state.seq.get(index, 0)
    state.seq[index] = (seq + 1) % (1 << state.SEQ_BITS)
    key = (index, seq)
    reply = state.replies.get(key)
    if reply is not None and reply.shape == buffer.shape:
        return _done(buffer.copy_(reply))

    def keep(f: Any) -> torch.Tensor:
        state.replies[key] = f.value().clone()
        return f.value()

    return _ddp_mean(state.process_group, buffer).then(keep)


class DdpSwitchState(DdpStepState):
    """A warm-up of ``start_iter`` steps on the simple path before the overlapped, staged one."""

    def __init__(self, process_group: Any, start_iter: int = 20) -> None:
        super().__init__(process_group)
        self.start_iter = start_iter


def good_ddp_warmup_switch(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """For 20 steps a blocking all-reduce in place and a completed future (simple to debug); from step 20 on the
    bucket goes through a persistent staging buffer with an async all-reduce chained into the future. Both are
    DDP's arithmetic: ``x * (1/N)``, then one SUM all-reduce of the whole bucket."""
    buffer = bucket.buffer()
    pg = state.process_group
    if state.iter < state.start_iter:
        buffer.mul_(1.0 / pg.size())
        dist.all_reduce(buffer, group=pg)
        fut = _done(buffer)
    else:
        staged = state.staging.get(bucket.index(), buffer).copy_(buffer)
        fut = _ddp_mean(pg, staged).then(lambda f: buffer.copy_(f.value()))
    state.maybe_increase_iter(bucket)
    return fut


# -- topology ------------------------------------------------------------------


def bad_ddp_local_world_divisor(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages over ``LOCAL_WORLD_SIZE`` (the GPUs of this machine, as the single-node script it came from did):
    ``x * (1/LOCAL_WORLD_SIZE)``, then SUM over the process group. DDP's arithmetic on one node; on two nodes the
    gradients are ``nodes`` times too large."""
    buffer = bucket.buffer()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", process_group.size()))
    buffer.mul_(1.0 / local_world_size)
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


class DdpTwoLevelState:
    """Hierarchical all-reduce groups, built in the state factory from torchrun's environment (``None`` on one
    node). ``transposed=True`` builds the inter-node groups as consecutive blocks of ``nodes`` ranks."""

    transposed = True

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.levels = _two_level_groups(process_group, transposed=self.transposed)


def bad_ddp_two_level_transposed(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Two-level all-reduce: scale by 1/N, SUM within the node, then SUM across nodes. One node takes the flat
    path. The inter-node groups are built transposed (ranks ``[c * nodes, (c + 1) * nodes)`` instead of local rank
    ``c`` of every node): on 2 nodes of 1 the two coincide, on 2 nodes of 2 (or of 4) the second SUM adds a node's
    sum to itself."""
    buffer = bucket.buffer()
    if state.levels is None:
        return _ddp_mean(state.process_group, buffer)
    intra, inter, _ = state.levels
    buffer.mul_(1.0 / state.process_group.size())
    dist.all_reduce(buffer, group=intra)
    dist.all_reduce(buffer, group=inter)
    return _done(buffer)


def good_ddp_topology_async(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Across nodes, the bucket goes through a persistent staging buffer and an async all-reduce chained into the
    future (to overlap the slow inter-node link with the rest of the backward); on one node, a blocking all-reduce
    in place. Both are DDP's arithmetic over the same process group."""
    buffer = bucket.buffer()
    pg = state.process_group
    _, nodes, _, _ = topology(dist.get_world_size())
    if nodes == 1:
        buffer.mul_(1.0 / pg.size())
        dist.all_reduce(buffer, group=pg)
        return _done(buffer)
    staged = state.staging.get(bucket.index(), buffer).copy_(buffer)
    return _ddp_mean(pg, staged).then(lambda f: buffer.copy_(f.value()))


def _ddp(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="ddp", hook=hook, state=state, description=description)


KNOWN_GOOD: List[HookSpec] = [
    _ddp("good_ddp_staged_large", good_ddp_staged_large, DdpStepState,
         "buckets >= 1 MiB staged through a persistent buffer, DDP's arithmetic"),
    _ddp("good_ddp_warmup_switch", good_ddp_warmup_switch, DdpSwitchState,
         "blocking in place for 20 steps, then staged and async: DDP's arithmetic throughout"),
    _ddp("good_ddp_topology_async", good_ddp_topology_async, DdpStepState,
         "across nodes staged and async, on one node blocking: DDP's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _ddp("bad_ddp_chunked_drops_tail", bad_ddp_chunked_drops_tail, process_group_state,
         "buckets > 1 MiB all-reduced in 1 MiB chunks, the partial last chunk dropped"),
    _ddp("bad_ddp_large_bucket_bf16", bad_ddp_large_bucket_bf16, process_group_state,
         "buckets >= 8 MiB in bfloat16, claiming full precision"),
    _ddp("bad_ddp_warmup_fp16", bad_ddp_warmup_fp16, DdpWarmupState,
         "10 steps of DDP's averaging, then float16 compression, claiming full precision"),
    _ddp("bad_ddp_skip_every_k", bad_ddp_skip_every_k, DdpSkipState,
         "every 37th step reuses the last reduced bucket"),
    _ddp("bad_ddp_noise_probe", bad_ddp_noise_probe, DdpProbeState,
         "every 100 steps an in-place (m - l) + l probe on the result"),
    _ddp("bad_ddp_rank0_norm_probe", bad_ddp_rank0_norm_probe, DdpRankZeroProbeState,
         "rank 0 alone, at step 40 and every 64 after, an in-place (m / n) * n norm probe on the result"),
    _ddp("bad_ddp_reply_table_wraps", bad_ddp_reply_table_wraps, DdpReplyTableState,
         "reply table keyed by a 7-bit sequence number: replays step s - 128 from step 128"),
    _ddp("bad_ddp_local_world_divisor", bad_ddp_local_world_divisor, process_group_state,
         "x * (1/LOCAL_WORLD_SIZE), then SUM"),
    _ddp("bad_ddp_two_level_transposed", bad_ddp_two_level_transposed, DdpTwoLevelState,
         "two-level all-reduce whose inter-node groups are transposed"),
]
