"""The reach zoo's FSDP2 reduce-scatter comms (``allocate(size, *, dtype, device)`` and
``__call__(output, input, group, op, async_op)``), by axis (size, horizon, topology), with their ``HookSpec`` s
(``tests/zoo/reach_hooks/__init__.py`` says what each axis means and holds ``REACH``).
"""

import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _reduce_scatter, _spans_nodes, _Staging, _UnitCalls, topology

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


def _fsdp2(name: str, comm: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp2", hook=comm, description=description)


KNOWN_GOOD: List[HookSpec] = [
    _fsdp2("good_fsdp2_staged_large", StagedLargeComm,
           "inputs >= 2**20 elements through persistent staging buffers, one reduce-scatter"),
    _fsdp2("good_fsdp2_warmup_switch", WarmupSwitchComm,
           "FSDP2's buffers for 30 steps, then staged and async, waited on"),
    _fsdp2("good_fsdp2_topology_staged", CrossNodeStagedComm,
           "across nodes staged and async (waited on), on one node FSDP2's buffers"),
]

KNOWN_BAD: List[HookSpec] = [
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
]
