"""The FSDP2 zoo's all-reduce hooks (``set_all_reduce_hook``, called under HSDP with the replicate-all-reduced
gradient): known-good and known-bad, each with its ``HookSpec`` and the config that must catch the bad ones.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.spec import HookSpec
from tests.zoo.plain_hooks import replica_divide_hook

# ---------------------------------------------------------------------------
# All-reduce hooks (native HSDP: called with the replicate-all-reduced gradient)
# ---------------------------------------------------------------------------

#: What ``observer_hook`` saw: (numel, dtype) per call; a realistic side channel.
OBSERVED: List[Any] = []


def observer_hook(tensor: torch.Tensor) -> None:
    """Right: reads the reduced gradient (its norm, for monitoring) and changes nothing."""
    OBSERVED.append((tensor.numel(), tensor.dtype, float(tensor.float().norm())))
    del OBSERVED[:-64]


def unit_scale_hook(tensor: torch.Tensor) -> None:
    """Right: an in-place gradient scaling hook configured with scale 1.0 (exact)."""
    tensor.mul_(1.0)


def world_average_hook(tensor: torch.Tensor) -> None:
    """Wrong: all-reduces (AVG) over the default group, averaging different shards together.

    Realistic: the user believes the hook must do the data-parallel all-reduce and reaches for
    the default group instead of the replicate group.
    """
    dist.all_reduce(tensor, op=ReduceOp.AVG)


def nan_to_zero_hook(tensor: torch.Tensor) -> None:
    """Wrong: replaces NaN and +/-Inf in the reduced gradient by zero (a "sanitizing" hook)."""
    torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_observer_hook", api="fsdp2_all_reduce", hook=observer_hook,
             description="all-reduce hook that only reads the gradient"),
    HookSpec(name="good_unit_scale_hook", api="fsdp2_all_reduce", hook=unit_scale_hook,
             description="all-reduce hook scaling in place by 1.0"),
]


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_world_average_hook", api="fsdp2_all_reduce", hook=world_average_hook,
             description="all-reduce hook averaging over the default group"),
    HookSpec(name="bad_replica_divide_hook", api="fsdp2_all_reduce", hook=replica_divide_hook,
             description="all-reduce hook dividing by the replicate size again"),
    HookSpec(name="bad_nan_to_zero_hook", api="fsdp2_all_reduce", hook=nan_to_zero_hook,
             description="replaces NaN and +/-Inf in the HSDP-reduced gradient by zero"),
]

#: For each known-bad spec here, the config that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_world_average_hook": "hsdp all-reduce hook: averaging across shard ranks mixes different shards",
    "bad_replica_divide_hook": "hsdp all-reduce hook: gradients are half the native value",
    "bad_nan_to_zero_hook": "hsdp all-reduce hook, hard inputs only: NaN and Inf come back as zeros",
}
