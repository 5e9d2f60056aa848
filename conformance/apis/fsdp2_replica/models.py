"""The rank side of a replica all-reduce hook: :class:`ReplicaModels`.

The reference is native HSDP on the 2-D (replicate x shard) mesh of the pool,
no hook. The hooked model is the same model under ``fully_shard`` on that
mesh's ``shard`` dimension alone, a 1-D mesh: FSDP2 reduce-scatters within the
shard group and all-reduces nothing, so the hook, installed with
``FSDPModule.set_all_reduce_hook`` on every FSDP module, is the whole reduction
across replicas (as in torchft's fault-tolerant HSDP). Gradients and parameters
are compared as for every FSDP2 API: local shards (both are sharded alike on
the shard dimension), then full tensors.
"""

from __future__ import annotations

from typing import Any, Tuple

from conformance.apis.fsdp2.build import build_fsdp2
from conformance.apis.fsdp2.models import Fsdp2Models
from conformance.apis.fsdp2.registration import register_on_every_module
from conformance.apis.fsdp2.standalone import REPLICA_SHARDS, replica_shape  # noqa: F401 - imported from here too
from conformance.apis.fsdp2_replica.arithmetic import ReplicaArithmetic
from conformance.apis.fsdp2_replica.recorder import ReplicaRecorder
from conformance.ranks.checks.models import Built
from conformance.shared.compare import dtype_name

__all__ = ["REPLICA_SHARDS", "ReplicaModels", "replica_shape"]

class ReplicaModels(Fsdp2Models):
    """A replica all-reduce hook's models on a pool of ``replicas x shards`` ranks (:func:`replica_shape`).

    Args:
        ctx, spec, model: as :class:`~conformance.ranks.checks.models.ApiModels`.
        config: ``"replica"``, the only one.
        micro_steps: backward passes per step, all but the last under ``set_requires_gradient_sync(False)``
            on both models (no reduce-scatter, no hook call).

    The hook's state is ``spec.state(replica_group)``, the process group across replicas (this rank's
    column of the mesh); the hook is called as ``hook(state, tensor)``.

    Raises:
        ValueError: ``config`` is not ``"replica"``; the pool does not fit a 2-D mesh.
    """

    def __init__(self, ctx: Any, spec: Any, *, model: str, config: str = "replica", micro_steps: int = 1):
        if config != "replica":
            raise ValueError(f"a replica all-reduce hook runs in config 'replica', not {config!r}")
        super().__init__(ctx, spec, model, micro_steps)
        self.shape = replica_shape(ctx.world_size)
        self.mesh = self._mesh(self.shape)
        self.replica_group = self.mesh.get_group("replicate")
        claim = "" if spec.reduce_dtype is None else f" with reduce_dtype={dtype_name(spec.reduce_dtype)}"
        self.reference = f"native HSDP on the {self.shape[0]}x{self.shape[1]} mesh{claim}"
        self.arithmetic = ReplicaArithmetic(self.shape[0], spec.reduce_dtype)

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        reduce_dtype = None if full_precision else self.spec.reduce_dtype
        if not hooked:
            ctx.phase(f"building the reference model (native HSDP, {self.shape[0]}x{self.shape[1]} mesh)")
            return Built(build_fsdp2(self.model_name, ctx, self.mesh, reduce_dtype=reduce_dtype))
        ctx.phase(f"building the hooked model (1-D mesh of {self.shape[1]} shards, the hook across replicas)")
        model = build_fsdp2(self.model_name, ctx, self.mesh["shard"], reduce_dtype=reduce_dtype)
        recorder = ReplicaRecorder(self.spec.hook, self.spec.state(self.replica_group), ctx.rank,
                                   self.replica_group, self.shape)
        register_on_every_module(model, "set_all_reduce_hook", recorder)
        return Built(model, recorder)
