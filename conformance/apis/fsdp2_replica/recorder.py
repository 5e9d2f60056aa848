"""What a replica all-reduce hook is handed and does, recorded for the checks and the diagnosis."""

from __future__ import annotations

import functools
from typing import Any, Tuple

from conformance.apis.fsdp2.recorders import HookRecorder

__all__ = ["ReplicaRecorder"]


class ReplicaRecorder(HookRecorder):
    """Calls ``hook(state, tensor)`` for FSDP2 (``set_all_reduce_hook`` takes ``hook(tensor)``) and records each
    call as :class:`~conformance.apis.fsdp2.recorders.HookRecorder` does, with the replica group as the group
    the diagnosis recomputes it over.

    Args:
        hook, state: the spec's hook and its state (``spec.state(replica_group)``).
        rank: this rank, for findings.
        replica_group: the process group across replicas the hook must reduce over.
        mesh_shape: ``(replicas, shards)``, for the note on a gradient finding.
    """

    def __init__(self, hook: Any, state: Any, rank: int, replica_group: Any, mesh_shape: Tuple[int, int]):
        super().__init__(functools.partial(hook, state), rank, mesh_shape, group=replica_group)

    def context(self, step: int) -> str:
        replicas, shards = self.mesh_shape
        return (f"the hook got the {self.dtypes(step)} reduce-scatter output of a {shards}-rank shard group, "
                f"to all-reduce over {replicas} replicas")
