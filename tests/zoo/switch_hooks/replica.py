"""The switch zoo's FSDP2 replica hooks, ``hook(state, tensor)`` with ``state = spec.state(replica_group)``, reducing
``tensor`` in place: a path taken only where two switches hold at once, a warm-up and a large tensor, or replicas
across nodes and a large tensor (``tests/zoo/switch_hooks/__init__.py`` says what the zoo holds). The line that
decides each one's other path ends in ``# switch``.
"""

from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _spans_nodes, _Staging, _UnitCalls

#: Calls per tensor size of the plain AVG all-reduce before the other path may start.
REPLICA_WARMUP_STEPS = 96
#: Replica tensors of this many elements and more take the other path (2 MiB of float32).
REPLICA_LARGE_NUMEL = 2 ** 19


class ReplicaSwitchState:
    """The replica group, a call count per tensor size and persistent staging buffers."""

    def __init__(self, replica_group: Any) -> None:
        self.group = replica_group
        self.units = _UnitCalls()
        self.staging = _Staging()


def _avg(group: Any, tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group)


def _bf16_avg(group: Any, tensor: torch.Tensor) -> None:
    low = tensor.to(torch.bfloat16)
    dist.all_reduce(low, op=ReduceOp.AVG, group=group)
    tensor.copy_(low)


def _staged_avg(state: ReplicaSwitchState, tensor: torch.Tensor) -> None:
    staged = state.staging.get("tensor", tensor).copy_(tensor)
    dist.all_reduce(staged, op=ReduceOp.AVG, group=state.group, async_op=True).wait()
    tensor.copy_(staged)


def bad_replica_warm_large_bf16(state, tensor):
    """Once warmed up (96 calls per tensor size), large tensors (2**19 elements and more) are averaged across
    replicas in bfloat16; everything else native HSDP's AVG all-reduce. Claims full precision."""
    warm = state.units.step_of(tensor.numel()) >= REPLICA_WARMUP_STEPS
    if warm and tensor.numel() >= REPLICA_LARGE_NUMEL:  # switch
        _bf16_avg(state.group, tensor)
    else:
        _avg(state.group, tensor)


def good_replica_warm_large_staged(state, tensor):
    """Once warmed up (96 calls per tensor size), large tensors (2**19 elements and more) go through a persistent
    staging buffer and an async all-reduce, waited on; native HSDP's arithmetic on every path."""
    warm = state.units.step_of(tensor.numel()) >= REPLICA_WARMUP_STEPS
    if warm and tensor.numel() >= REPLICA_LARGE_NUMEL:  # switch
        _staged_avg(state, tensor)
    else:
        _avg(state.group, tensor)


def bad_replica_nodes_large_bf16(state, tensor):
    """Where the replica group crosses nodes, large tensors (2**19 elements and more) are averaged in bfloat16 on
    the slow link; everything else native HSDP's AVG all-reduce. Claims full precision."""
    if _spans_nodes(state.group) and tensor.numel() >= REPLICA_LARGE_NUMEL:  # switch
        _bf16_avg(state.group, tensor)
    else:
        _avg(state.group, tensor)


def good_replica_nodes_large_staged(state, tensor):
    """Where the replica group crosses nodes, large tensors (2**19 elements and more) go through a persistent
    staging buffer and an async all-reduce, waited on; native HSDP's arithmetic on every path."""
    if _spans_nodes(state.group) and tensor.numel() >= REPLICA_LARGE_NUMEL:  # switch
        _staged_avg(state, tensor)
    else:
        _avg(state.group, tensor)


def _replica(name: str, hook: Any, description: str, **kwargs: Any) -> HookSpec:
    return HookSpec(name=name, api="fsdp2_replica", hook=hook, state=ReplicaSwitchState, description=description,
                    **kwargs)


KNOWN_GOOD: List[HookSpec] = [
    _replica("good_replica_warm_large_staged", good_replica_warm_large_staged,
             "after 96 calls per size, tensors >= 2**19 elements staged and async: native HSDP's arithmetic"),
    _replica("good_replica_nodes_large_staged", good_replica_nodes_large_staged,
             "replicas across nodes, tensors >= 2**19 elements staged and async: native HSDP's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _replica("bad_replica_warm_large_bf16", bad_replica_warm_large_bf16,
             "after 96 calls per size, tensors >= 2**19 elements averaged in bfloat16, claiming full precision"),
    _replica("bad_replica_nodes_large_bf16", bad_replica_nodes_large_bf16,
             "replicas across nodes, tensors >= 2**19 elements averaged in bfloat16, claiming full precision"),
]
