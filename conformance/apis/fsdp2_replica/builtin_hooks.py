"""The reference replica all-reduce hook, as specs: the suite's default ``api="fsdp2_replica"`` subjects.

PyTorch ships no hook for this API. :func:`replica_avg_all_reduce` is the
project's known-good one, the example to copy (torchft's and torchtitan's
fault-tolerant HSDP do the same): an AVG all-reduce of the reduce-scatter
output, in place, over the replica group. It is checked in full precision and
under ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``, the two reduce dtypes
for which native HSDP all-reduces with ``ReduceOp.AVG``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from conformance.spec import HookSpec

__all__ = ["REPLICA_HOOKS", "default_hook", "replica_avg_all_reduce", "replica_group_state"]


def replica_group_state(replica_group: dist.ProcessGroup) -> Any:
    """The hook's state: the process group across replicas itself."""
    return replica_group


def replica_avg_all_reduce(replica_group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Average ``tensor`` (this rank's reduce-scatter output, already averaged over its shard group) over the
    replicas, in place: ``dist.all_reduce(tensor, op=ReduceOp.AVG, group=replica_group)``, as native HSDP's
    replica all-reduce does (``foreach_reduce``). FSDP2 ignores the return value and reads ``tensor`` after
    the call; install it with ``module.set_all_reduce_hook(functools.partial(replica_avg_all_reduce, group))``
    on every FSDP module."""
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=replica_group)


REPLICA_HOOKS = [
    HookSpec(name="replica_avg_all_reduce", api="fsdp2_replica", hook=replica_avg_all_reduce,
             state=replica_group_state,
             description="conformance.apis.fsdp2_replica.builtin_hooks.replica_avg_all_reduce, full precision"),
    HookSpec(name="replica_avg_all_reduce_bf16", api="fsdp2_replica", hook=replica_avg_all_reduce,
             state=replica_group_state, reduce_dtype=torch.bfloat16,
             description="replica_avg_all_reduce under MixedPrecisionPolicy(reduce_dtype=bfloat16)"),
    # torchtitan's default pair: the hook gets float32 gradients of bfloat16 parameters. A sample in the default run
    # (sample_checks); native HSDP under the same policy is its reference.
    HookSpec(name="replica_avg_all_reduce_params_bf16", api="fsdp2_replica", hook=replica_avg_all_reduce,
             state=replica_group_state, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             sample_checks=("fsdp2_replica_parity",),
             description="replica_avg_all_reduce under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)"),
]


def default_hook(spec: HookSpec, params: Dict[str, Any], world_size: int) -> Optional[str]:
    """The name, in :data:`REPLICA_HOOKS`, of the hook that stands for native HSDP's replica all-reduce in a
    case of ``spec`` (``ControllerSide.default_hook``), under the same claim; ``None`` for a float16 claim (native
    divides before and after the all-reduce there, outside the hook); under a claimed parameter dtype, the
    bfloat16-parameter sample for that pair alone."""
    if spec.param_dtype is not None:
        return ("replica_avg_all_reduce_params_bf16"
                if (spec.param_dtype, spec.reduce_dtype) == (torch.bfloat16, torch.float32) else None)
    return {None: "replica_avg_all_reduce", torch.float32: "replica_avg_all_reduce",
            torch.bfloat16: "replica_avg_all_reduce_bf16"}.get(spec.reduce_dtype)
