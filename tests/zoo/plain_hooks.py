"""Zoo hooks whose module imports only torch, as a hook author's own package does.

A standalone reproducer (``--write-reproducers``) imports the hook and its state
from their module, and nothing of the suite: these hooks live apart from the zoo
modules that wrap them in ``HookSpec`` s (``ddp_hooks``, ``fsdp_hooks``,
``fsdp2_comms`` import them from here), so ``tests/test_reproducers.py`` can run
their reproducers where ``conformance`` cannot be imported. One bad hook per API,
each with the helpers the zoo shares, and the DDP hook README's reproducer example shows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

# -- DDP: hook(state, bucket) -> Future -------------------------------------------------------------------


def process_group_state(process_group: Any) -> Any:
    """DDP hooks here take the process group itself as their state."""
    return process_group


def mean_allreduce(process_group: Any, tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    """DDP's own averaging: scale by the reciprocal of the world size, then SUM all-reduce."""
    tensor.mul_(1.0 / process_group.size())
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def bad_sum_then_divide(process_group, bucket):
    """SUM, then divides by the world size: the textbook average, 1-2 ULP off DDP's x * (1/N) at 3 ranks (README's
    reproducer example, so its hook import is torch only)."""
    return dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future().then(
        lambda f: f.value()[0].div_(process_group.size()))


def bad_saturates_inf_off_rank0(process_group, bucket):
    """DDP's averaging, but ranks other than 0 first saturate +Inf to float32's max (as if only rank 0,
    which holds a loss scaler, were meant to see overflow). No named hard input has +Inf off rank 0,
    so only generated examples find it: this hook exists to show that a generated failure is shrunk
    to its minimal example (one +Inf on one rank other than 0)."""
    buffer = bucket.buffer()
    if dist.get_rank(process_group) != 0:
        buffer.clamp_(max=torch.finfo(buffer.dtype).max)
    return mean_allreduce(process_group, buffer)


# -- FSDP1: hook(state, grad, output=None), state a DefaultState ------------------------------------------


def fsdp_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False):
    """``reduce_scatter_single`` (what FSDP1 calls); older torch only has ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def sum_no_average_hook(state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Wrong: reduces with SUM and never divides, so gradients are ``world_size`` times too big.

    Realistic: ``all_reduce`` defaults to SUM, and a hook ported from code that scaled the
    loss by ``1 / world_size`` elsewhere drops the averaging.
    """
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
    else:
        fsdp_reduce_scatter(output, grad, state.process_group)


# -- FSDP2: a comm (allocate, __call__); an all-reduce hook(tensor); a replica hook(state, tensor) ----------


def comm_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, op: Any, group: Any, async_op: bool = False):
    """``reduce_scatter_single`` with ``op`` (``reduce_scatter_tensor`` on older torch)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


class Alloc:
    """``allocate`` exactly as FSDP2's ``DefaultAllocMixin``: a fresh tensor per call."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AlwaysSumComm(Alloc):
    """Wrong: ignores ``op`` and always reduces with ``ReduceOp.SUM``.

    Right only where FSDP2 itself passes SUM (float16, forced SUM); with the default
    float32/bfloat16 ``AVG`` every gradient is ``world_size`` times too large. Realistic: SUM is
    the collective's default, and a comm ported from FSDP1 (where hooks get no op) drops it.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return comm_reduce_scatter(output_tensor, input_tensor, op=ReduceOp.SUM, group=group, async_op=async_op)


def replica_divide_hook(tensor: torch.Tensor) -> None:
    """Wrong: divides by the replicate size, which native HSDP has already averaged over.

    Realistic: a hook written for the 1-D "FSDP + my own replica all-reduce with SUM" setup and
    reused unchanged under native HSDP.
    """
    tensor.div_(2)


def replica_state(replica_group: Any) -> Any:
    """A replica hook's state: the process group across replicas itself."""
    return replica_group


def replica_sum(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: SUMs over the replicas and never averages (native HSDP averages)."""
    dist.all_reduce(tensor, group=group)
