"""What a replica all-reduce hook is handed and does, recorded for the checks and the diagnosis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Tuple

from conformance.apis.fsdp2_common.recorders import HookRecorder

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["ReplicaRecorder"]


class ReplicaRecorder(HookRecorder):
    """Calls the hook bound to its state (``hook(state, tensor)`` as ``set_all_reduce_hook``'s ``hook(tensor)``,
    :func:`~conformance.apis.fsdp2_common.setup.bind_to_replicas`) and records each call as
    :class:`~conformance.apis.fsdp2_common.recorders.HookRecorder` does, with the replica group as the group the
    diagnosis recomputes it over.

    Args:
        hook: the spec's hook bound to its state (``spec.state(replica_group)``).
        rank: this rank, for findings.
        replica_group: the process group across replicas the hook must reduce over.
        mesh_shape: ``(replicas, shards)``, for the note on a gradient finding.
    """

    def __init__(self, hook: Callable[[torch.Tensor], object], rank: int, replica_group: ProcessGroup,
                 mesh_shape: Tuple[int, int]):
        super().__init__(hook, rank, mesh_shape, group=replica_group)

    def context(self, step: int) -> str:
        replicas, shards = self.mesh_shape
        return (f"the hook got the {self.dtypes(step)} reduce-scatter output of a {shards}-rank shard group, "
                f"to all-reduce over {replicas} replicas")
