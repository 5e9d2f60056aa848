"""Hooks that are right but cost more than native on the wire (issue 47): the suite passes them and names the cost.

Each is bit for bit native's arithmetic at 2 ranks on gloo, so every case of it conforms there; what it costs
shows only in the verdict's ``cost vs native:`` line and the JSON's ``hooks[].cost`` (``tests/test_cost.py``, which
runs them at 2 ranks).

* ``good_ddp_extra_all_reduce``: DDP's default arithmetic (``x (1/N)``, SUM all-reduce) plus, per bucket, a SUM
  all-reduce of a 1-element "any rank saw a non-finite gradient" flag that nothing reads (an overflow check left
  in from debugging, or one a logger was meant to consume): twice native's collectives, about native's bytes.
* ``good_ddp_float64_wire``: ``x (1/N)`` in float32 as default DDP does, then the bucket cast to float64, a SUM
  all-reduce in float64, and the result copied back into the float32 bucket ("sum in double for accuracy"):
  twice native's bytes, float64 on the wire. At 2 ranks the float64 sum of two float32 values rounded to float32
  is the float32 sum (float64 has more than 2 x 24 + 2 significand bits, so the double rounding is harmless); at 3
  ranks it is not the float32 sum gloo rounds twice, so this hook is good at 2 ranks only.
* ``good_fsdp2_all_gather_reduce``: an FSDP2 reduce-scatter comm that all-gathers every rank's full flat input
  into an ``(N, numel)`` buffer, sums the rows locally in rank order, applies the op it is handed (``AVG``: divide
  by N, as gloo's AVG is a SUM then a divide; ``SUM``: nothing) and keeps its own shard ("a deterministic
  reduce-scatter", the all-gather standing in for a backend without one). The recorder counts each collective's
  *input*: the all-gather's input is the full flat input, as the reduce-scatter's is, so its bytes are about
  native's; what changes is the kind (``all_gather`` where native issues a reduce-scatter, which gloo's recorder
  may name ``all_reduce``). The sum in rank order is gloo's at 2 ranks (one addition); at 3 it need not be.

Only ``torch`` is imported (and the suite's ``HookSpec``): the zoo is imported by the controller and every rank.
"""

from typing import Any, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec


def process_group_state(process_group: Any) -> Any:
    return process_group


def extra_flag_all_reduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bucket x (1/N)``, a SUM all-reduce (default DDP's arithmetic), and a second all-reduce per bucket: a
    1-element count of ranks whose bucket holds a non-finite value, which nothing reads."""
    buffer = bucket.buffer()
    flag = (~torch.isfinite(buffer)).any().to(torch.float32).reshape(1)
    dist.all_reduce(flag, group=process_group)  # the extra collective: its result is dropped
    buffer.mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def float64_wire(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bucket x (1/N)`` in the bucket's dtype, then a SUM all-reduce of it in float64, copied back."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    wide = buffer.to(torch.float64)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(wide, group=process_group, async_op=True).get_future().then(back)


#: The non-deprecated reduce-scatter and all-gather where torch has them (2.13), else the ones older torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllGatherReduce:
    """A reduce-scatter comm that all-gathers every rank's full input and reduces it locally (buffers from
    ``torch.empty``, as FSDP2's default allocator)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # PREMUL_SUM (NCCL): the collective's own
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        n = group.size()
        flat = input_tensor.contiguous().view(-1)
        gathered = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        _all_gather(gathered, flat, group=group)  # gloo takes a 1-D output: rank r's input at [r * numel:]
        rows = gathered.view(n, -1)
        total = rows[0].clone()
        for row in rows[1:]:
            total += row
        if op == dist.ReduceOp.AVG:
            total.div_(n)
        output_tensor.copy_(total.view(n, -1)[group.rank()].view_as(output_tensor))
        return None


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_ddp_extra_all_reduce", api="ddp", hook=extra_flag_all_reduce, state=process_group_state,
             description="x 1/world_size, SUM, plus an unread 1-element all-reduce per bucket"),
    HookSpec(name="good_ddp_float64_wire", api="ddp", hook=float64_wire, state=process_group_state,
             description="x 1/world_size in float32, then a SUM all-reduce in float64"),
    HookSpec(name="good_fsdp2_all_gather_reduce", api="fsdp2", hook=AllGatherReduce,
             description="a reduce-scatter comm that all-gathers the full input and reduces it locally"),
]
ALL: List[HookSpec] = KNOWN_GOOD
