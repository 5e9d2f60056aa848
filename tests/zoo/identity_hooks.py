"""Known-good hooks that hold ``torch.distributed``'s objects to their identity (issue 44): whatever the suite
measures while a hook runs, it must not change what the hook's code sees.

* ``dist.P2POp(dist.isend, ...)`` checks that its op *is* ``torch.distributed.isend`` (``P2POp`` raises
  ``ValueError: Invalid op`` otherwise): a real replica all-reduce from a public training repository builds its
  recursive-doubling exchange that way, with ``dist.batch_isend_irecv``;
* a hook that refuses a patched ``torch.distributed`` (frameworks check that a collective is the one they
  tested against) compares ``dist.all_reduce`` with ``torch.distributed.distributed_c10d.all_reduce``.

Each hook exchanges with ``batch_isend_irecv`` where its group has 2 ranks (one exchange: ``a + b`` is what a SUM
all-reduce of 2 ranks computes, so the result is native bit for bit) and falls back to one all-reduce otherwise.
Only ``torch`` is imported (and the suite's ``HookSpec``): the zoo is imported by the controller and every rank.
No ``from __future__ import annotations``: DDP compares a hook's annotations with ``dist.GradBucket`` as objects.
"""

from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, distributed_c10d

from conformance.spec import HookSpec


def _untouched() -> None:
    """Raise where ``torch.distributed``'s collectives are not PyTorch's own functions."""
    for name in ("all_reduce", "isend", "irecv", "batch_isend_irecv"):
        if getattr(dist, name) is not getattr(distributed_c10d, name):
            raise RuntimeError(f"torch.distributed.{name} is not PyTorch's own function: refusing to run on a "
                               "patched torch.distributed")


def _exchange_sum(tensor: torch.Tensor, group: Any) -> None:
    """``tensor += the other rank's tensor``, by one ``batch_isend_irecv`` of ``P2POp(dist.isend, ...)`` and
    ``P2POp(dist.irecv, ...)``: ``group`` has exactly 2 ranks."""
    me = dist.get_rank()
    peer = next(r for r in dist.get_process_group_ranks(group) if r != me)
    theirs = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, peer, group=group), dist.P2POp(dist.irecv, theirs, peer, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    tensor.add_(theirs)


def identity_state(process_group: Any) -> Any:
    return process_group


def good_ddp_p2p_exchange(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's averaging (``x * (1/N)``, then a SUM), the SUM by a point-to-point exchange where the process group
    has 2 ranks; refuses a patched ``torch.distributed``."""
    _untouched()
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    if process_group.size() == 2:
        _exchange_sum(buffer, process_group)
    else:
        dist.all_reduce(buffer, group=process_group)
    fut: Any = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def good_replica_p2p_exchange(replica_group, tensor):
    """Native HSDP's replica average (gloo's AVG: SUM, then a divide by the group's size), the SUM by a
    recursive-doubling exchange of ``P2POp`` s where there are 2 replicas; refuses a patched
    ``torch.distributed``."""
    _untouched()
    if replica_group.size() == 2:
        _exchange_sum(tensor, replica_group)
        tensor.div_(2)
    else:
        dist.all_reduce(tensor, op=ReduceOp.AVG, group=replica_group)


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_ddp_p2p_exchange", api="ddp", hook=good_ddp_p2p_exchange, state=identity_state,
             description="DDP's averaging, the SUM of 2 ranks by dist.P2POp(dist.isend, ...) and batch_isend_irecv"),
    HookSpec(name="good_replica_p2p_exchange", api="fsdp2_replica", hook=good_replica_p2p_exchange,
             state=identity_state,
             description="replica AVG, 2 replicas by dist.P2POp(dist.isend, ...) and batch_isend_irecv"),
]
ALL: List[HookSpec] = list(KNOWN_GOOD)
