"""The FSDP2 zoo's replica hooks (``hook(group, tensor)``: the all-reduce across the replicas of an HSDP mesh, in
place): known-good and known-bad, each with its ``HookSpec`` and the config that must catch the bad ones.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.apis.fsdp2_replica.builtin_hooks import replica_group_state
from conformance.spec import HookSpec
from tests.zoo.plain_hooks import replica_state, replica_sum


def replica_sum_then_divide(group: Any, tensor: torch.Tensor) -> None:
    """Right: SUM over the replica group, then divide by its size, in place (AVG by hand): torchft's averaging,
    whose ``Manager.allreduce`` sums and then does ``tensor /= num_participants`` (pytorch/torchft, PR 286)."""
    dist.all_reduce(tensor, group=group)
    tensor.div_(group.size())


def replica_async_avg(group: Any, tensor: torch.Tensor) -> None:
    """Right: an async AVG all-reduce over the replica group, waited on before returning."""
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=True).wait()


def replica_world_divisor(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: SUM over the replica group, then divides by dist.get_world_size(), every rank of the mesh (4),
    not the replicas (2)."""
    dist.all_reduce(tensor, group=group)
    tensor.div_(dist.get_world_size())


def replica_divide_then_sum(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: divides by the replica count, then SUMs. Exact at 2 replicas but on subnormals, where the halved
    values lose their last bit; at 3 replicas x / 3 rounds on ordinary values too."""
    tensor.div_(group.size())
    dist.all_reduce(tensor, group=group)


def replica_default_group(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: averages over the default group (no group=), mixing different shards."""
    dist.all_reduce(tensor, op=ReduceOp.AVG)


def replica_out_of_place(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Wrong: averages a copy and returns it; FSDP2 ignores the return value and reads the tensor it passed."""
    out = tensor.clone()
    dist.all_reduce(out, op=ReduceOp.AVG, group=group)
    return out


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_replica_sum_then_divide", api="fsdp2_replica", hook=replica_sum_then_divide,
             state=replica_group_state, description="replica hook: SUM, then / replica count, in place"),
    HookSpec(name="good_replica_async_avg", api="fsdp2_replica", hook=replica_async_avg,
             state=replica_group_state, description="replica hook: async AVG all-reduce, waited on"),
]


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_replica_sum", api="fsdp2_replica", hook=replica_sum, state=replica_state,
             description="replica hook: SUM over the replicas, no average"),
    HookSpec(name="bad_replica_world_divisor", api="fsdp2_replica", hook=replica_world_divisor,
             state=replica_group_state, description="replica hook: SUM, then / dist.get_world_size()"),
    HookSpec(name="bad_replica_divide_then_sum", api="fsdp2_replica", hook=replica_divide_then_sum,
             state=replica_group_state, description="replica hook: / replica count, then SUM"),
    HookSpec(name="bad_replica_default_group", api="fsdp2_replica", hook=replica_default_group,
             state=replica_group_state, description="replica hook: AVG over the default group"),
    HookSpec(name="bad_replica_out_of_place", api="fsdp2_replica", hook=replica_out_of_place,
             state=replica_group_state, description="replica hook: averages a copy and returns it"),
]

#: For each known-bad spec here, the config that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_replica_sum": "replica: twice native HSDP's average; the diagnosis names a SUM without averaging",
    "bad_replica_world_divisor": (
        "replica: divided by the default group's 4 ranks, not the 2 replicas; the diagnosis names the divisor's "
        "source"
    ),
    "bad_replica_divide_then_sum": (
        "replica, hard inputs at 2 replicas: halved subnormals lose their last bit where native divides the "
        "sum; at 3 replicas (a 6-rank pool) parity too"
    ),
    "bad_replica_default_group": "replica: averaging over the default group mixes different shards",
    "bad_replica_out_of_place": (
        "replica: the shards stay the shard group's average; FSDP2 reads the tensor it passed, not the return value"
    ),
}
