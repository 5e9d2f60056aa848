"""The reach zoo's shared helpers: torchrun's topology as a hook reads it, native averaging of each API, staging
buffers and per-unit call counts (``tests/zoo/reach_hooks/__init__.py`` says what the zoo holds).

Only ``torch`` and ``torch.distributed`` are imported: the zoo is imported by the controller and by every rank
process. No ``from __future__ import annotations`` (see ``ddp.py``: DDP's hooks need their annotations as objects).
"""

import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

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
