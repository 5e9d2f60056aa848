"""What a replica all-reduce hook is handed and does, recorded for the checks and the diagnosis."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from conformance.protocol import Finding
from conformance.ranks.checks.models import Recorder
from conformance.ranks.compare import dtype_name
from conformance.ranks.diagnosis import CallLog, HookCall, counting_collectives

__all__ = ["ReplicaRecorder"]


class ReplicaRecorder(Recorder):
    """Calls ``hook(state, tensor)`` for FSDP2 (``set_all_reduce_hook`` takes ``hook(tensor)``); records each
    call's input, in-place result and collectives, with the replica group as the call's group.

    Args:
        hook, state: the spec's hook and its state (``spec.state(replica_group)``).
        rank: this rank, for findings.
        replica_group: the process group across replicas the hook must reduce over.
        mesh_shape: ``(replicas, shards)``, for the note on a gradient finding.
    """

    def __init__(self, hook: Any, state: Any, rank: int, replica_group: Any, mesh_shape: Tuple[int, int]):
        self.hook = hook
        self.state = state
        self.rank = rank
        self.replica_group = replica_group
        self.mesh_shape = mesh_shape
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.log = CallLog()

    def __call__(self, tensor: torch.Tensor) -> Any:
        index = sum(1 for c in self.calls if c["step"] == self.step)
        self.calls.append({"step": self.step, "dtype": tensor.dtype, "numel": tensor.numel()})
        call = self.log.add(HookCall(self.step, index, f"call {index} ({tensor.numel()} elements)",
                                     tensor.detach().reshape(-1).clone(), group=self.replica_group))
        with counting_collectives() as count:
            result = self.hook(self.state, tensor)
        call.collectives = count[0]
        call.group_sizes = tuple(count.group_sizes)
        call.settle_from(tensor)
        return result

    def context(self, step: int) -> str:
        seen = sorted({dtype_name(c["dtype"]) for c in self.calls if c["step"] == step})
        replicas, shards = self.mesh_shape
        return (f"the hook got the {'/'.join(seen) or '?'} reduce-scatter output of a {shards}-rank shard group, "
                f"to all-reduce over {replicas} replicas")

    def findings(self, step: int) -> List[Finding]:
        """A finished step in which FSDP2 never called the hook: then nothing reduced across replicas."""
        if not any(c["step"] == step for c in self.calls):
            return [Finding(self.rank, "FSDP2 never called the all-reduce hook in this step", step=step,
                            kind="contract")]
        return []
