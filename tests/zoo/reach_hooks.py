"""A zoo of hooks whose bugs lie past the suite's small, short, one-node cases (issue 28): known-good and known-bad.

Real hooks switch code paths on three axes the small cases never touch, and each
hook here switches on one of them:

* **size**: a path taken only above a buffer size (a DDP bucket, an FSDP1 flat
  gradient, an FSDP2 reduce-scatter input, a replica tensor): a chunk loop that
  drops the tail, "large buffers go low precision", an async launch whose ``Work``
  nobody waits for. The good twins stage large buffers through persistent
  buffers: another path, the same arithmetic. None of them chunks an all-reduce
  or a reduce-scatter: on gloo at 3 ranks a chunked all-reduce sums in another
  order than one all-reduce of the whole buffer, so a chunk loop is never bitwise
  native there, tail or no tail;
* **horizon**: a path taken only after many steps, counted as a hook can (a step
  counter that advances on the last bucket, as PowerSGD's ``maybe_increase_iter``
  does, or a call count per FSDP unit, keyed by the unit's gradient size): a
  warm-up that ends in a wrong path, communication skipping that reuses the last
  result, a periodic probe that writes into the result (on every rank, or on rank 0
  alone), a 7-bit/6-bit sequence
  number whose reply table is never evicted. The good twins end their warm-up in
  another implementation of the same arithmetic. Every threshold is at step 10 or
  later (0-based), and under 200;
* **topology**: a path taken only when the environment torchrun sets says the job
  spans several nodes (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_RANK``; absent,
  one node is assumed): a divisor read from ``LOCAL_WORLD_SIZE``, a two-level
  reduction over the wrong groups or averaged twice, bfloat16 on the inter-node
  link. The good twins take an async or staged path across nodes, with the same
  arithmetic. Hooks that build process groups build them in the state factory,
  collectively, the same on every rank, and only where the state's process group
  spans the whole world (a subgroup keeps the one-node path).

``REACH`` says, for every hook, its axis and where its threshold lies, in a form a
meta-test or ``scripts/reach_zoo_evidence.py`` (which establishes each verdict
outside the suite) can use: ``numel`` (size: the buffer elements at or above which
the other path runs, and ``buffer``, which buffer), ``first_step`` (horizon: the
0-based step whose gradients differ first, on a model whose FSDP units all differ
in size, in DDP's default config), ``layouts`` (topology: the ``nodes x
ranks-per-node`` layouts on which a bad hook differs; on the others it is native).
DDP's first iteration runs with one bucket for the whole model (measured: 7,057,750
elements, then 6,553,625 and 504,125 from step 1 on), so a 1-4 MiB bucket exists
only from step 1, and in configs whose buckets are rebuilt after step 0 a reply
table keyed at step 0 may first replay a step later.

Units of the same gradient size share one call counter (an FSDP hook sees no unit
identity), so on a model with ``k`` units of one size an FSDP horizon threshold
arrives ``k`` times sooner; the smallest FSDP threshold here is step 15, still
past the suite's four-step cases with up to 3 such units.

DDP hooks are annotated ``bucket: dist.GradBucket`` and ``-> torch.futures.Future[torch.Tensor]`` (so the
suite knows they take a bucket and plans no compiled-autograd case for them). The annotations must be the
objects: DDP's ``register_comm_hook`` refuses a hook whose annotations are strings ("bucket annotation should
be dist.GradBucket"), which ``from __future__ import annotations`` would make them, so this module does not
import it.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the
suite's ``HookSpec``, as every zoo): the zoo is imported by the controller and by
every rank process.
"""

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "REACH", "topology"]


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def topology(world_size: int) -> Tuple[int, int, int, int]:
    """``(local_world_size, nodes, node_rank, local_rank)`` as torchrun's environment says, one node where it is unset.

    What a hook author writes: ``LOCAL_WORLD_SIZE`` (ranks per node), ``GROUP_RANK`` (the node's rank) and
    ``LOCAL_RANK``; the node count is ``world_size // LOCAL_WORLD_SIZE``.
    """
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(os.environ.get("GROUP_RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % local_world_size))
    return local_world_size, max(1, world_size // local_world_size), node_rank, local_rank


def _spans_nodes(group: Any) -> bool:
    """Whether ``group``'s ranks lie on more than one node (node = global rank // ``LOCAL_WORLD_SIZE``)."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return len({r // local_world_size for r in dist.get_process_group_ranks(group)}) > 1


def _done(tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    fut: Any = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _ddp_mean(process_group: Any, tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    """DDP's own averaging: ``tensor * (1 / world_size)``, then a SUM all-reduce, in place."""
    tensor.mul_(1.0 / process_group.size())
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any, op: Any = ReduceOp.SUM,
                    async_op: bool = False) -> Any:
    """``reduce_scatter_single`` (what FSDP1 calls); ``reduce_scatter_tensor`` on older torch."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def _div_if_needed(tensor: torch.Tensor, factor: float) -> None:
    if factor > 1:
        tensor.div_(factor)


def _fsdp_native(state: Any, grad: torch.Tensor, output: Optional[torch.Tensor], *, async_op: bool = False,
                 into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FSDP1's full-precision averaging (pre-divide, SUM, post-divide); returns the tensor that holds the result.

    ``into``: reduce into this tensor instead of ``output`` (sharded) or ``grad`` (``NO_SHARD``, ``into`` holding a
    copy of ``grad``); the caller copies it back.
    """
    _div_if_needed(grad, state.gradient_predivide_factor)
    if output is None:
        target = grad if into is None else into.copy_(grad)
        work = dist.all_reduce(target, group=state.process_group, async_op=async_op)
    else:
        target = output if into is None else into
        work = _reduce_scatter(target, grad, state.process_group, async_op=async_op)
    if async_op:
        work.wait()
    _div_if_needed(target, state.gradient_postdivide_factor)
    return target


def _fsdp_in(dtype: torch.dtype, state: Any, grad: torch.Tensor, output: Optional[torch.Tensor]) -> None:
    """FSDP1's averaging done in ``dtype`` (``MixedPrecision(reduce_dtype=dtype)``'s arithmetic), cast back."""
    low = grad.to(dtype)
    _div_if_needed(low, state.gradient_predivide_factor)
    if output is None:
        dist.all_reduce(low, group=state.process_group)
        _div_if_needed(low, state.gradient_postdivide_factor)
        grad.copy_(low)
    else:
        low_out = torch.empty(output.shape, dtype=dtype, device=output.device)
        _reduce_scatter(low_out, low, state.process_group)
        _div_if_needed(low_out, state.gradient_postdivide_factor)
        output.copy_(low_out)


class _Staging:
    """Persistent staging buffers, one per (name, dtype, device), grown on demand (never shrunk): the
    "registered memory" a transport keeps for large messages.

    A DDP hook names its buffer by the bucket's index: DDP calls the hook for the next bucket while an earlier
    bucket's async all-reduce is still running, so one buffer shared by every bucket is overwritten in flight
    (measured: gradients off by 7e2 at 3 ranks from step 1, where the 2-bucket model's buckets overlap).
    FSDP1, FSDP2 and replica hooks here finish their collective before they return, and share one buffer."""

    def __init__(self) -> None:
        self._buffers: Dict[Any, torch.Tensor] = {}

    def get(self, name: Any, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, str(like.device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:like.numel()].view(like.shape)


class _UnitCalls:
    """Call counts per FSDP unit, keyed by the unit's gradient size (a hook sees no unit identity)."""

    def __init__(self) -> None:
        self.calls: Dict[Any, int] = {}

    def step_of(self, key: Any) -> int:
        """The 0-based count of earlier calls with this key: the step, for a unit reduced once a step."""
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return n


def _two_level_groups(process_group: Any, *, transposed: bool = False) -> Optional[Tuple[Any, Any, int]]:
    """``(intra_node_group, inter_node_group, local_world_size)`` of this rank, or ``None`` on one node.

    Built collectively: every rank creates every group, in the same order (``new_group`` must be called by every
    rank of the default group). Only where ``process_group`` spans the whole world: on a subgroup, ``None``.
    ``transposed``: the inter-node groups are built as consecutive blocks of ``nodes`` ranks (the classic
    row/column slip), where they should take the same local rank on every node.
    """
    world_size = dist.get_world_size()
    local_world_size, nodes, _, _ = topology(world_size)
    if nodes == 1 or dist.get_world_size(process_group) != world_size or world_size % local_world_size:
        return None
    rank = dist.get_rank()
    intra = inter = None
    for node in range(nodes):
        ranks = list(range(node * local_world_size, (node + 1) * local_world_size))
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            intra = group
    for column in range(local_world_size):
        if transposed:
            ranks = list(range(column * nodes, (column + 1) * nodes))
        else:
            ranks = [node * local_world_size + column for node in range(nodes)]
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            inter = group
    return intra, inter, local_world_size


# ===========================================================================
# DDP: hook(state, bucket) -> Future[Tensor]
# ===========================================================================

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


# ===========================================================================
# FSDP1: hook(state, grad) (NO_SHARD), hook(state, grad, output) (sharded)
# ===========================================================================

#: Shard (or NO_SHARD gradient) chunk of bad_fsdp_chunked_drops_tail, and the size above which it chunks.
FSDP_CHUNK_NUMEL = 2 ** 20
#: Flat gradients of 2**21 elements and more are reduced in float16 by bad_fsdp_large_fp16.
FSDP_FP16_NUMEL = 2 ** 21
#: Results of 2**20 elements and more go through a persistent buffer in good_fsdp_pooled_output.
FSDP_POOL_NUMEL = 2 ** 20


class FsdpState(DefaultState):
    """``DefaultState`` (the process group and FSDP's pre/post-divide factors), plus a call count per unit and
    persistent buffers, fresh per model."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.units = _UnitCalls()
        self.staging = _Staging()


# -- size --------------------------------------------------------------------


def bad_fsdp_chunked_drops_tail(state, grad, output=None):
    """FSDP's averaging, but results above 2**20 elements are reduced in 2**20-element chunks (a reduce-scatter
    of one column block of the ``(world_size, shard)`` view at a time; NO_SHARD: an all-reduce per chunk),
    ``numel // CHUNK`` of them: the last partial chunk is never reduced (sharded: ``output`` keeps whatever its
    fresh memory held; NO_SHARD: the local gradient, pre-divided)."""
    c = FSDP_CHUNK_NUMEL
    target = grad if output is None else output
    if target.numel() <= c:
        _fsdp_native(state, grad, output)
        return
    _div_if_needed(grad, state.gradient_predivide_factor)
    for i in range(target.numel() // c):
        if output is None:
            dist.all_reduce(grad[i * c:(i + 1) * c], group=state.process_group)
        else:
            block = grad.view(state.world_size, -1)[:, i * c:(i + 1) * c].reshape(-1)  # rank r's columns, r-major
            _reduce_scatter(output[i * c:(i + 1) * c], block, state.process_group)
    _div_if_needed(target, state.gradient_postdivide_factor)


def bad_fsdp_large_fp16(state, grad, output=None):
    """FSDP's averaging, but flat gradients of 2**21 elements and more are reduced in float16 (MixedPrecision(
    reduce_dtype=float16)'s arithmetic, cast back): "large units are bandwidth-bound". Claims full precision."""
    if grad.numel() >= FSDP_FP16_NUMEL:
        _fsdp_in(torch.float16, state, grad, output)
    else:
        _fsdp_native(state, grad, output)


def good_fsdp_pooled_output(state, grad, output=None):
    """Results of 2**20 elements and more are reduced into a persistent buffer (no allocator churn for the big
    units) and copied into ``output`` (NO_SHARD: ``grad``): FSDP's own arithmetic on both sides."""
    target = grad if output is None else output
    if target.numel() < FSDP_POOL_NUMEL:
        _fsdp_native(state, grad, output)
        return
    result = _fsdp_native(state, grad, output, into=state.staging.get("result", target))
    target.copy_(result)


# -- horizon -------------------------------------------------------------------


class FsdpWarmupState(FsdpState):
    def __init__(self, process_group: Any, start_step: int = 150) -> None:
        super().__init__(process_group)
        self.start_step = start_step


def bad_fsdp_warmup_bf16(state, grad, output=None):
    """Warm-up: FSDP's averaging for 150 steps per unit, then bfloat16 compression (MixedPrecision(reduce_dtype=
    bfloat16)'s arithmetic, cast back) from step 150 on, while claiming full precision."""
    if state.units.step_of(grad.numel()) < state.start_step:
        _fsdp_native(state, grad, output)
    else:
        _fsdp_in(torch.bfloat16, state, grad, output)


class FsdpSkipState(FsdpState):
    def __init__(self, process_group: Any, skip_every: int = 16) -> None:
        super().__init__(process_group)
        self.skip_every = skip_every
        self.last: Dict[int, torch.Tensor] = {}


def bad_fsdp_skip_every_k(state, grad, output=None):
    """Communication skipping: every 16th call per unit (the first at step 15) copies the unit's last result
    instead of reducing."""
    key = grad.numel()
    target = grad if output is None else output
    last = state.last.get(key)
    if (state.units.step_of(key) + 1) % state.skip_every == 0 and last is not None and last.shape == target.shape:
        target.copy_(last)
        return
    _fsdp_native(state, grad, output)
    state.last[key] = target.detach().clone()


class FsdpProbeState(FsdpState):
    def __init__(self, process_group: Any, probe_every: int = 50) -> None:
        super().__init__(process_group)
        self.probe_every = probe_every
        self.noise: List[float] = []


def bad_fsdp_noise_probe(state, grad, output=None):
    """FSDP's averaging; every 50 steps per unit (the first at step 50) a gradient-noise probe measures
    ``|mean - local|`` in place on the result and adds this rank's local gradient back: ``(m - l) + l`` is not
    ``m`` in floating point."""
    step = state.units.step_of(grad.numel())
    probe = step > 0 and step % state.probe_every == 0
    local = None
    if probe:
        local = grad.clone() if output is None else grad.view(state.world_size, -1)[
            dist.get_rank(state.process_group)].clone()
    target = _fsdp_native(state, grad, output)
    if probe:
        target.sub_(local)
        state.noise.append(float(target.norm()))
        target.add_(local)


class FsdpSwitchState(FsdpState):
    def __init__(self, process_group: Any, start_step: int = 25) -> None:
        super().__init__(process_group)
        self.start_step = start_step


def good_fsdp_warmup_switch(state, grad, output=None):
    """For 25 steps per unit, reduces into a fresh tensor and copies it out (the conservative path while memory
    settles); from step 25 on, reduces straight into ``output`` (NO_SHARD: ``grad``) with ``async_op=True`` and a
    wait. FSDP's arithmetic on both paths."""
    if state.units.step_of(grad.numel()) < state.start_step:
        target = grad if output is None else output
        target.copy_(_fsdp_native(state, grad, output, into=torch.empty_like(target)))
    else:
        _fsdp_native(state, grad, output, async_op=True)


# -- topology ------------------------------------------------------------------


class NodeFactorState(DefaultState):
    """``DefaultState`` whose pre/post-divide factors come from ``LOCAL_WORLD_SIZE`` ("the ranks I average over"),
    as DefaultState computes them from the world size."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.gradient_predivide_factor = self._get_gradient_predivide_factor(local_world_size)
        self.gradient_postdivide_factor = local_world_size / self.gradient_predivide_factor


def bad_fsdp_node_factors(state, grad, output=None):
    """FSDP's averaging with factors from ``LOCAL_WORLD_SIZE`` (``NodeFactorState``): FSDP's own factors on one
    node; on two nodes the gradients are ``nodes`` times too large."""
    _fsdp_native(state, grad, output)


class FsdpTwoLevelState(DefaultState):
    """``DefaultState`` plus hierarchical groups from torchrun's environment (``levels`` is ``None`` on one node)."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.levels = _two_level_groups(process_group)


def bad_fsdp_two_level_avg_twice(state, grad, output=None):
    """Hierarchical averaging across nodes: all-reduce within the node and divide by ``LOCAL_WORLD_SIZE`` (the
    node's mean), all-reduce across nodes and divide by the world size (meant: by the node count), then take this
    rank's shard. One node takes FSDP's path. The mean is divided twice: right on 2 nodes of 1 (the node mean is
    the local gradient), ``LOCAL_WORLD_SIZE`` times too small on 2 nodes of 2."""
    if state.levels is None:
        _fsdp_native(state, grad, output)
        return
    intra, inter, local_world_size = state.levels
    dist.all_reduce(grad, group=intra)
    _div_if_needed(grad, local_world_size)
    dist.all_reduce(grad, group=inter)
    grad.div_(state.world_size)
    if output is not None:
        output.copy_(grad.view(state.world_size, -1)[dist.get_rank(state.process_group)])


def good_fsdp_topology_async(state, grad, output=None):
    """Across nodes, launches the collective with ``async_op=True`` and waits (where a real hook overlaps the slow
    inter-node link); on one node, blocking. FSDP's arithmetic on both paths."""
    _, nodes, _, _ = topology(dist.get_world_size())
    _fsdp_native(state, grad, output, async_op=nodes > 1)


# ===========================================================================
# FSDP2: a ReduceScatter comm, allocate(size, *, dtype, device) and __call__(output, input, group, op, async_op)
# ===========================================================================

#: Inputs of 2**21 elements and more are launched async, their Work returned, by bad_fsdp2_async_unwaited.
FSDP2_ASYNC_NUMEL = 2 ** 21
#: Inputs above 2**20 elements are reduce-scattered in output chunks of 2**18 by bad_fsdp2_chunked_drops_tail.
FSDP2_CHUNK_ABOVE = 2 ** 20
FSDP2_CHUNK_NUMEL = 2 ** 18
#: Inputs of 2**20 elements and more are staged by good_fsdp2_staged_large.
FSDP2_STAGE_NUMEL = 2 ** 20


class _Comm:
    """``allocate`` as FSDP2's ``DefaultAllocMixin`` (a fresh tensor per call), a call count per input size, and
    persistent staging buffers."""

    def __init__(self) -> None:
        self.units = _UnitCalls()
        self.staging = _Staging()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def staged(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
               async_op: bool = False) -> None:
        """Copy the input into a persistent buffer, reduce-scatter into another (waited on), copy the output out."""
        staged_in = self.staging.get("in", input_tensor).copy_(input_tensor)
        staged_out = self.staging.get("out", output_tensor)
        work = _reduce_scatter(staged_out, staged_in, group, op=op, async_op=async_op)
        if async_op:
            work.wait()
        output_tensor.copy_(staged_out)

    @staticmethod
    def wire(dtype: torch.dtype, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any) -> None:
        """Reduce-scatter in ``dtype`` on the wire, the result cast back into ``output_tensor``."""
        low_out = torch.empty(output_tensor.shape, dtype=dtype, device=output_tensor.device)
        _reduce_scatter(low_out, input_tensor.to(dtype), group, op=op)
        output_tensor.copy_(low_out)


# -- size --------------------------------------------------------------------


class AsyncUnwaitedComm(_Comm):
    """Overlap for large messages: inputs of 2**21 elements and more are launched with ``async_op=True`` and the
    ``Work`` is returned ("the caller waits on it"); smaller ones are blocking. FSDP2 calls the comm with
    ``async_op=False`` and never waits on what it returns: it reads the output before the collective wrote it."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if input_tensor.numel() >= FSDP2_ASYNC_NUMEL:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=True)
        return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)


class ChunkedDropsTailComm(_Comm):
    """Inputs above 2**20 elements are reduce-scattered in output chunks of 2**18 elements (one column block of
    the ``(world_size, shard)`` view at a time), ``shard // CHUNK`` of them: the output's last partial chunk is
    never written and keeps whatever ``allocate``'s fresh memory held."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if input_tensor.numel() <= FSDP2_CHUNK_ABOVE:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        c = FSDP2_CHUNK_NUMEL
        rows = input_tensor.view(group.size(), -1)
        for i in range(output_tensor.numel() // c):
            block = rows[:, i * c:(i + 1) * c].reshape(-1)  # rank r's columns, r-major
            _reduce_scatter(output_tensor[i * c:(i + 1) * c], block, group, op=op)
        return None


class StagedLargeComm(_Comm):
    """Inputs of 2**20 elements and more go through persistent staging buffers (registered memory), in one
    reduce-scatter with FSDP2's ``op``: FSDP2's arithmetic on both sides of the threshold."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if input_tensor.numel() < FSDP2_STAGE_NUMEL:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        self.staged(output_tensor, input_tensor, group, op)
        return None


# -- horizon -------------------------------------------------------------------


class WarmupBf16Comm(_Comm):
    """Warm-up: FSDP2's reduce-scatter for 90 calls per unit, then bfloat16 on the wire from step 90 on, while
    claiming full precision."""

    START = 90

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.units.step_of((input_tensor.numel(), input_tensor.dtype)) < self.START:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        self.wire(torch.bfloat16, output_tensor, input_tensor, group, op)
        return None


class ReplyTableComm(_Comm):
    """Idempotent delivery: replies kept by (input size, 6-bit sequence number per size), a resent input answered
    from the table. Never evicted, and the number wraps after 64 calls: from step 64 on each call is "a resend"
    of the one 64 steps before and gets that step's shard."""

    SEQ_BITS = 6

    def __init__(self) -> None:
        super().__init__()
        self.replies: Dict[Any, torch.Tensor] = {}

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        size = (input_tensor.numel(), input_tensor.dtype)
        key = (size, self.units.step_of(size) % (1 << self.SEQ_BITS))
        reply = self.replies.get(key)
        if reply is not None and reply.shape == output_tensor.shape:
            output_tensor.copy_(reply)
            return None
        _reduce_scatter(output_tensor, input_tensor, group, op=op)
        self.replies[key] = output_tensor.detach().clone()
        return None


class WarmupSwitchComm(_Comm):
    """For 30 calls per unit a blocking reduce-scatter into FSDP2's buffers; from step 30 on the persistent staging
    buffers with an async reduce-scatter, waited on. FSDP2's arithmetic on both paths."""

    START = 30

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.units.step_of((input_tensor.numel(), input_tensor.dtype)) < self.START:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        self.staged(output_tensor, input_tensor, group, op, async_op=True)
        return None


# -- topology ------------------------------------------------------------------


class LocalWorldAvgComm(_Comm):
    """A portable AVG for transports without one: ``AVG`` becomes SUM, then a divide by ``LOCAL_WORLD_SIZE`` (read
    once, at construction). On one node that is the shard group's size (and gloo's AVG is SUM, then that divide);
    on two nodes the gradients are ``nodes`` times too large."""

    def __init__(self) -> None:
        super().__init__()
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op != ReduceOp.AVG:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        _reduce_scatter(output_tensor, input_tensor, group, op=ReduceOp.SUM)
        output_tensor.div_(self.local_world_size or group.size())
        return None


class CrossNodeBf16Comm(_Comm):
    """Compresses the slow link: where the shard group spans nodes (its ranks on more than one node, as torchrun's
    ``LOCAL_WORLD_SIZE`` places them), bfloat16 on the wire; within a node FSDP2's reduce-scatter. Claims full
    precision."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if not _spans_nodes(group):
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        self.wire(torch.bfloat16, output_tensor, input_tensor, group, op)
        return None


class CrossNodeStagedComm(_Comm):
    """Where the job spans several nodes, the persistent staging buffers and an async reduce-scatter, waited on;
    on one node FSDP2's buffers, blocking. FSDP2's arithmetic on both paths."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        _, nodes, _, _ = topology(dist.get_world_size())
        if nodes == 1:
            return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)
        self.staged(output_tensor, input_tensor, group, op, async_op=True)
        return None


# ===========================================================================
# FSDP2 replica: hook(state, tensor), state = spec.state(replica_group), reduces tensor in place
# ===========================================================================

#: Tensors above 2**19 elements are all-reduced in 2**18-element chunks by bad_replica_chunked_drops_tail.
REPLICA_CHUNK_ABOVE = 2 ** 19
REPLICA_CHUNK_NUMEL = 2 ** 18
#: Tensors of 2**20 elements and more go bfloat16 in bad_replica_large_bf16.
REPLICA_BF16_NUMEL = 2 ** 20
#: Tensors of 2**19 elements and more are staged by good_replica_staged_large.
REPLICA_STAGE_NUMEL = 2 ** 19


class ReplicaState:
    """The replica group, a call count per tensor size and persistent staging buffers."""

    def __init__(self, replica_group: Any) -> None:
        self.group = replica_group
        self.units = _UnitCalls()
        self.staging = _Staging()


def _replica_avg(group: Any, tensor: torch.Tensor, async_op: bool = False) -> None:
    work = dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=async_op)
    if async_op:
        work.wait()


def _replica_bf16(group: Any, tensor: torch.Tensor) -> None:
    low = tensor.to(torch.bfloat16)
    dist.all_reduce(low, op=ReduceOp.AVG, group=group)
    tensor.copy_(low)


def _replica_staged(state: ReplicaState, tensor: torch.Tensor, async_op: bool = False) -> None:
    staged = state.staging.get("tensor", tensor).copy_(tensor)
    _replica_avg(state.group, staged, async_op=async_op)
    tensor.copy_(staged)


# -- size --------------------------------------------------------------------


def bad_replica_chunked_drops_tail(state, tensor):
    """Tensors above 2**19 elements are AVG-all-reduced across replicas in 2**18-element chunks, ``numel //
    CHUNK`` of them: the last partial chunk keeps this replica's shard-group average."""
    if tensor.numel() <= REPLICA_CHUNK_ABOVE:
        _replica_avg(state.group, tensor)
        return
    c = REPLICA_CHUNK_NUMEL
    for i in range(tensor.numel() // c):
        _replica_avg(state.group, tensor[i * c:(i + 1) * c])


def bad_replica_large_bf16(state, tensor):
    """Tensors of 2**20 elements and more cross the replicas in bfloat16 (AVG, cast back); smaller ones in full
    precision. Claims full precision."""
    if tensor.numel() >= REPLICA_BF16_NUMEL:
        _replica_bf16(state.group, tensor)
    else:
        _replica_avg(state.group, tensor)


def good_replica_staged_large(state, tensor):
    """Tensors of 2**19 elements and more go through a persistent staging buffer, one AVG all-reduce, copied back:
    native HSDP's arithmetic on both sides."""
    if tensor.numel() >= REPLICA_STAGE_NUMEL:
        _replica_staged(state, tensor)
    else:
        _replica_avg(state.group, tensor)


# -- horizon -------------------------------------------------------------------


class LocalSgdState(ReplicaState):
    """Post-local-SGD: ``start_step`` steps of full synchronisation, then replicas average every ``sync_every``."""

    def __init__(self, replica_group: Any, start_step: int = 45, sync_every: int = 4) -> None:
        super().__init__(replica_group)
        self.start_step = start_step
        self.sync_every = sync_every


def bad_replica_local_sgd(state, tensor):
    """Post-local-SGD (``start_localSGD_iter`` = 45): AVG across replicas on every step until step 45, then only on
    steps that are multiples of 4, the replicas training locally in between (a periodic model averager is supposed
    to reconcile them). Claims native HSDP's exact averaging: step 45 is the first one skipped."""
    step = state.units.step_of(tensor.numel())
    if step < state.start_step or step % state.sync_every == 0:
        _replica_avg(state.group, tensor)


class ReplicaProbeState(ReplicaState):
    def __init__(self, replica_group: Any, probe_every: int = 75) -> None:
        super().__init__(replica_group)
        self.probe_every = probe_every
        self.noise: List[float] = []


def bad_replica_noise_probe(state, tensor):
    """AVG across replicas; every 75 steps (the first at step 75) a replica-noise probe measures ``|mean - local|``
    in place on the result and adds this replica's value back: ``(m - l) + l`` is not ``m`` in floating point."""
    step = state.units.step_of(tensor.numel())
    probe = step > 0 and step % state.probe_every == 0
    local = tensor.clone() if probe else None
    _replica_avg(state.group, tensor)
    if probe:
        tensor.sub_(local)
        state.noise.append(float(tensor.norm()))
        tensor.add_(local)


class ReplicaSwitchState(ReplicaState):
    def __init__(self, replica_group: Any, start_step: int = 12) -> None:
        super().__init__(replica_group)
        self.start_step = start_step


def good_replica_warmup_switch(state, tensor):
    """For 12 steps a blocking AVG all-reduce in place; from step 12 on a persistent staging buffer and an async AVG
    all-reduce, waited on. Native HSDP's arithmetic on both paths."""
    if state.units.step_of(tensor.numel()) < state.start_step:
        _replica_avg(state.group, tensor)
    else:
        _replica_staged(state, tensor, async_op=True)


# -- topology ------------------------------------------------------------------


def bad_replica_local_divisor(state, tensor):
    """SUM across replicas, then divides by the replicas on this node, ``LOCAL_WORLD_SIZE // shards`` (written where
    every replica lived on one machine). On one node that is the replica count (and gloo's AVG is SUM, then that
    divide); on 2 nodes of 2 it is 1: the gradients are the replicas' SUM."""
    shards = dist.get_world_size() // state.group.size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    dist.all_reduce(tensor, group=state.group)
    tensor.div_(max(1, local_world_size // shards))


def bad_replica_cross_node_bf16(state, tensor):
    """Compresses the slow link: where the replica group spans nodes, bfloat16 across replicas (AVG, cast back); on
    one node full precision. Claims full precision."""
    if _spans_nodes(state.group):
        _replica_bf16(state.group, tensor)
    else:
        _replica_avg(state.group, tensor)


def good_replica_topology_async(state, tensor):
    """Where the replica group spans nodes, a persistent staging buffer and an async AVG all-reduce, waited on; on
    one node a blocking AVG in place. Native HSDP's arithmetic on both paths."""
    if _spans_nodes(state.group):
        _replica_staged(state, tensor, async_op=True)
    else:
        _replica_avg(state.group, tensor)


# ===========================================================================
# Specs
# ===========================================================================


def _ddp(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="ddp", hook=hook, state=state, description=description)


def _fsdp(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp", hook=hook, state=state, description=description)


def _fsdp2(name: str, comm: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp2", hook=comm, description=description)


def _replica(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp2_replica", hook=hook, state=state, description=description)


KNOWN_GOOD: List[HookSpec] = [
    _ddp("good_ddp_staged_large", good_ddp_staged_large, DdpStepState,
         "buckets >= 1 MiB staged through a persistent buffer, DDP's arithmetic"),
    _ddp("good_ddp_warmup_switch", good_ddp_warmup_switch, DdpSwitchState,
         "blocking in place for 20 steps, then staged and async: DDP's arithmetic throughout"),
    _ddp("good_ddp_topology_async", good_ddp_topology_async, DdpStepState,
         "across nodes staged and async, on one node blocking: DDP's arithmetic"),
    _fsdp("good_fsdp_pooled_output", good_fsdp_pooled_output, FsdpState,
          "results >= 2**20 elements reduced into a persistent buffer, FSDP's arithmetic"),
    _fsdp("good_fsdp_warmup_switch", good_fsdp_warmup_switch, FsdpSwitchState,
          "fresh tensor and copy for 25 steps, then async straight into output: FSDP's arithmetic"),
    _fsdp("good_fsdp_topology_async", good_fsdp_topology_async, FsdpState,
          "across nodes async and waited on, on one node blocking: FSDP's arithmetic"),
    _fsdp2("good_fsdp2_staged_large", StagedLargeComm,
           "inputs >= 2**20 elements through persistent staging buffers, one reduce-scatter"),
    _fsdp2("good_fsdp2_warmup_switch", WarmupSwitchComm,
           "FSDP2's buffers for 30 steps, then staged and async, waited on"),
    _fsdp2("good_fsdp2_topology_staged", CrossNodeStagedComm,
           "across nodes staged and async (waited on), on one node FSDP2's buffers"),
    _replica("good_replica_staged_large", good_replica_staged_large, ReplicaState,
             "tensors >= 2**19 elements through a persistent buffer, one AVG all-reduce"),
    _replica("good_replica_warmup_switch", good_replica_warmup_switch, ReplicaSwitchState,
             "blocking AVG for 12 steps, then staged and async AVG, waited on"),
    _replica("good_replica_topology_async", good_replica_topology_async, ReplicaState,
             "replicas across nodes: staged and async AVG; on one node blocking AVG"),
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
    _fsdp("bad_fsdp_chunked_drops_tail", bad_fsdp_chunked_drops_tail, FsdpState,
          "results > 2**20 elements reduced in 2**20 chunks, the partial last chunk dropped"),
    _fsdp("bad_fsdp_large_fp16", bad_fsdp_large_fp16, FsdpState,
          "flat gradients >= 2**21 elements reduced in float16, claiming full precision"),
    _fsdp("bad_fsdp_warmup_bf16", bad_fsdp_warmup_bf16, FsdpWarmupState,
          "150 steps of FSDP's averaging, then bfloat16, claiming full precision"),
    _fsdp("bad_fsdp_skip_every_k", bad_fsdp_skip_every_k, FsdpSkipState,
          "every 16th call per unit copies the unit's last result"),
    _fsdp("bad_fsdp_noise_probe", bad_fsdp_noise_probe, FsdpProbeState,
          "every 50 steps an in-place (m - l) + l probe on the result"),
    _fsdp("bad_fsdp_node_factors", bad_fsdp_node_factors, NodeFactorState,
          "pre/post-divide factors from LOCAL_WORLD_SIZE"),
    _fsdp("bad_fsdp_two_level_avg_twice", bad_fsdp_two_level_avg_twice, FsdpTwoLevelState,
          "two-level all-reduce dividing by LOCAL_WORLD_SIZE and then by the world size"),
    _fsdp2("bad_fsdp2_async_unwaited", AsyncUnwaitedComm,
           "inputs >= 2**21 elements: async reduce-scatter, Work returned where FSDP2 asked for a blocking call"),
    _fsdp2("bad_fsdp2_chunked_drops_tail", ChunkedDropsTailComm,
           "inputs > 2**20 elements reduce-scattered in 2**18 chunks, the partial last chunk dropped"),
    _fsdp2("bad_fsdp2_warmup_bf16", WarmupBf16Comm,
           "90 steps of FSDP2's reduce-scatter, then bfloat16 on the wire"),
    _fsdp2("bad_fsdp2_reply_table_wraps", ReplyTableComm,
           "reply table keyed by a 6-bit sequence number: replays step s - 64 from step 64"),
    _fsdp2("bad_fsdp2_local_world_avg", LocalWorldAvgComm,
           "AVG done as SUM / LOCAL_WORLD_SIZE"),
    _fsdp2("bad_fsdp2_cross_node_bf16", CrossNodeBf16Comm,
           "bfloat16 on the wire when the job spans nodes"),
    _replica("bad_replica_chunked_drops_tail", bad_replica_chunked_drops_tail, ReplicaState,
             "tensors > 2**19 elements in 2**18 chunks, the partial last chunk dropped"),
    _replica("bad_replica_large_bf16", bad_replica_large_bf16, ReplicaState,
             "tensors >= 2**20 elements cross the replicas in bfloat16"),
    _replica("bad_replica_local_sgd", bad_replica_local_sgd, LocalSgdState,
             "post-local-SGD: from step 45 the replicas average every 4th step only"),
    _replica("bad_replica_noise_probe", bad_replica_noise_probe, ReplicaProbeState,
             "every 75 steps an in-place (m - l) + l probe on the result"),
    _replica("bad_replica_local_divisor", bad_replica_local_divisor, ReplicaState,
             "SUM, then / (LOCAL_WORLD_SIZE // shards)"),
    _replica("bad_replica_cross_node_bf16", bad_replica_cross_node_bf16, ReplicaState,
             "bfloat16 across replicas when the replica group spans nodes"),
]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: Where each hook's other path starts. ``axis``: "size", "horizon" or "topology". Size: ``numel``, the elements at
#: or above which the other path runs (strictly above for the chunk loops), and ``buffer``, which buffer. Horizon:
#: ``first_step``, the 0-based step whose gradients differ first (for a good hook: the step its other path starts).
#: Topology: ``layouts``, the ``"nodes x ranks-per-node"`` layouts on which a bad hook differs from native (a good one
#: takes its other path on every multi-node layout).
REACH: Dict[str, Dict[str, Any]] = {
    "good_ddp_staged_large": {"axis": "size", "numel": DDP_STAGE_NUMEL, "buffer": "DDP bucket"},
    "bad_ddp_chunked_drops_tail": {"axis": "size", "numel": DDP_CHUNK_NUMEL, "buffer": "DDP bucket"},
    "bad_ddp_large_bucket_bf16": {"axis": "size", "numel": DDP_BF16_NUMEL, "buffer": "DDP bucket"},
    "good_fsdp_pooled_output": {"axis": "size", "numel": FSDP_POOL_NUMEL, "buffer": "FSDP1 result (shard)"},
    "bad_fsdp_chunked_drops_tail": {"axis": "size", "numel": FSDP_CHUNK_NUMEL, "buffer": "FSDP1 result (shard)"},
    "bad_fsdp_large_fp16": {"axis": "size", "numel": FSDP_FP16_NUMEL, "buffer": "FSDP1 flat gradient"},
    "good_fsdp2_staged_large": {"axis": "size", "numel": FSDP2_STAGE_NUMEL, "buffer": "FSDP2 reduce-scatter input"},
    "bad_fsdp2_async_unwaited": {"axis": "size", "numel": FSDP2_ASYNC_NUMEL, "buffer": "FSDP2 reduce-scatter input"},
    "bad_fsdp2_chunked_drops_tail": {"axis": "size", "numel": FSDP2_CHUNK_ABOVE,
                                     "buffer": "FSDP2 reduce-scatter input"},
    "good_replica_staged_large": {"axis": "size", "numel": REPLICA_STAGE_NUMEL, "buffer": "replica tensor"},
    "bad_replica_chunked_drops_tail": {"axis": "size", "numel": REPLICA_CHUNK_ABOVE, "buffer": "replica tensor"},
    "bad_replica_large_bf16": {"axis": "size", "numel": REPLICA_BF16_NUMEL, "buffer": "replica tensor"},
    "good_ddp_warmup_switch": {"axis": "horizon", "first_step": 20},
    "bad_ddp_warmup_fp16": {"axis": "horizon", "first_step": 10},
    "bad_ddp_skip_every_k": {"axis": "horizon", "first_step": 36},
    "bad_ddp_noise_probe": {"axis": "horizon", "first_step": 100},
    "bad_ddp_reply_table_wraps": {"axis": "horizon", "first_step": 128},
    "bad_ddp_rank0_norm_probe": {"axis": "horizon", "first_step": 40},
    "good_fsdp_warmup_switch": {"axis": "horizon", "first_step": 25},
    "bad_fsdp_warmup_bf16": {"axis": "horizon", "first_step": 150},
    "bad_fsdp_skip_every_k": {"axis": "horizon", "first_step": 15},
    "bad_fsdp_noise_probe": {"axis": "horizon", "first_step": 50},
    "good_fsdp2_warmup_switch": {"axis": "horizon", "first_step": 30},
    "bad_fsdp2_warmup_bf16": {"axis": "horizon", "first_step": 90},
    "bad_fsdp2_reply_table_wraps": {"axis": "horizon", "first_step": 64},
    "good_replica_warmup_switch": {"axis": "horizon", "first_step": 12},
    "bad_replica_local_sgd": {"axis": "horizon", "first_step": 45},
    "bad_replica_noise_probe": {"axis": "horizon", "first_step": 75},
    "good_ddp_topology_async": {"axis": "topology", "layouts": ()},
    "bad_ddp_local_world_divisor": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_ddp_two_level_transposed": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "good_fsdp_topology_async": {"axis": "topology", "layouts": ()},
    "bad_fsdp_node_factors": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_fsdp_two_level_avg_twice": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "good_fsdp2_topology_staged": {"axis": "topology", "layouts": ()},
    "bad_fsdp2_local_world_avg": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_fsdp2_cross_node_bf16": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "good_replica_topology_async": {"axis": "topology", "layouts": ()},
    "bad_replica_local_divisor": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "bad_replica_cross_node_bf16": {"axis": "topology", "layouts": ("2x2", "2x4")},
}

_SMALL = ("bitwise native on every case the suite ran before issue 28 (buffers of at most 8,427 elements, at most "
          "4 steps, one node)")

#: For each known-bad hook: the check that must catch it, and why nothing weaker can.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_ddp_chunked_drops_tail": (
        "parity on a bucket above 1 MiB (the 1-4 MiB bucket and the 25 MiB one): the last numel % 2**18 elements "
        "keep the local gradient * (1/N); " + _SMALL),
    "bad_ddp_large_bucket_bf16": (
        "parity on the 25 MiB bucket only (a 1-4 MiB bucket stays below 8 MiB): rounded to bfloat16; " + _SMALL),
    "bad_ddp_warmup_fp16": "long-run parity, first differs at step 10 (float16 rounding); " + _SMALL,
    "bad_ddp_skip_every_k": "long-run parity, first differs at step 36 (the step-35 gradient reused); " + _SMALL,
    "bad_ddp_noise_probe": "long-run parity, first differs at step 100 (a few ULPs); " + _SMALL,
    "bad_ddp_rank0_norm_probe": (
        "long-run parity, first differs at step 40 on rank 0 only (a few ULPs), between two check-ins: every rank "
        "must go on training after its first difference; " + _SMALL),
    "bad_ddp_reply_table_wraps": "long-run parity, first differs at step 128 (step 0's gradient replayed); " + _SMALL,
    "bad_ddp_local_world_divisor": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): gradients nodes times the mean; DDP's own "
        "arithmetic with no environment, and with one node's wherever LOCAL_WORLD_SIZE is the process group's size "
        "(where a subgroup case runs under the pool's LOCAL_WORLD_SIZE, the subgroup config catches it too)"),
    "bad_ddp_two_level_transposed": (
        "parity on 4 ranks as 2 nodes of 2 (and 8 as 2 of 4): the inter-node SUM adds a node's sum to itself; on 2 "
        "nodes of 1 the transposed groups are the right ones, and one node takes the flat path"),
    "bad_fsdp_chunked_drops_tail": (
        "parity on a flat parameter above 2**20 elements a shard (2**22 at 2 ranks): the last shard % 2**20 elements "
        "are never reduced; " + _SMALL),
    "bad_fsdp_large_fp16": "parity on a flat gradient of 2**21 elements or more: float16 rounding; " + _SMALL,
    "bad_fsdp_warmup_bf16": "long-run parity, first differs at step 150 (bfloat16 rounding); " + _SMALL,
    "bad_fsdp_skip_every_k": (
        "long-run parity, first differs at step 15 (sooner on a model with several units of one size, which share "
        "a counter); " + _SMALL),
    "bad_fsdp_noise_probe": "long-run parity, first differs at step 50 (a few ULPs); " + _SMALL,
    "bad_fsdp_node_factors": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): divided by LOCAL_WORLD_SIZE, not the world "
        "size; FSDP's own factors with no environment, and with one node's wherever LOCAL_WORLD_SIZE is the process "
        "group's size (subgroup_parity under the pool's LOCAL_WORLD_SIZE catches it too)"),
    "bad_fsdp_two_level_avg_twice": (
        "parity on 4 ranks as 2 nodes of 2 (and 8 as 2 of 4): the mean divided by LOCAL_WORLD_SIZE once more; on 2 "
        "nodes of 1 the node mean is the local gradient and the result is FSDP's"),
    "bad_fsdp2_async_unwaited": (
        "parity on a reduce-scatter input of 2**21 elements or more: FSDP2 reads the output before the collective "
        "wrote it (a race; seen on every such step here); " + _SMALL),
    "bad_fsdp2_chunked_drops_tail": (
        "parity on a reduce-scatter input above 2**20 elements: the output's last shard % 2**18 elements are never "
        "written; " + _SMALL),
    "bad_fsdp2_warmup_bf16": "long-run parity, first differs at step 90 (bfloat16 on the wire); " + _SMALL,
    "bad_fsdp2_reply_table_wraps": "long-run parity, first differs at step 64 (step 0's shard replayed); " + _SMALL,
    "bad_fsdp2_local_world_avg": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): SUM / LOCAL_WORLD_SIZE is nodes times the "
        "mean; with one node's environment also the hsdp and subgroup configs (a shard group of 2 under a "
        "LOCAL_WORLD_SIZE of 4); with no environment it divides by the group's size, gloo's AVG"),
    "bad_fsdp2_cross_node_bf16": "parity with a 2-node environment: bfloat16 on the wire; native on one node",
    "bad_replica_chunked_drops_tail": (
        "replica parity on a tensor above 2**19 elements: the last numel % 2**18 elements keep this replica's "
        "shard-group average; " + _SMALL),
    "bad_replica_large_bf16": "replica parity on a tensor of 2**20 elements or more: bfloat16 rounding; " + _SMALL,
    "bad_replica_local_sgd": "long-run replica parity, first differs at step 45 (no replica average); " + _SMALL,
    "bad_replica_noise_probe": "long-run replica parity, first differs at step 75 (a few ULPs); " + _SMALL,
    "bad_replica_local_divisor": (
        "replica parity on 4 ranks as 2 nodes of 2: SUM across replicas divided by 1; on one node the divisor is the "
        "replica count"),
    "bad_replica_cross_node_bf16": (
        "replica parity on 4 ranks as 2 nodes of 2 (the replica groups {0, 2}, {1, 3} cross nodes): bfloat16; on one "
        "node full precision"),
}
