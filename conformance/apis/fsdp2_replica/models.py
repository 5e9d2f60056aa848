"""The rank side of a replica all-reduce hook: :class:`ReplicaModels`.

The reference is native HSDP on the 2-D (replicate x shard) mesh of the pool,
no hook. The hooked model is the same model under ``fully_shard`` on that
mesh's ``shard`` dimension alone, a 1-D mesh: FSDP2 reduce-scatters within the
shard group and all-reduces nothing, so the hook, installed with
``FSDPModule.set_all_reduce_hook`` on every FSDP module, is the whole reduction
across replicas (as in torchft's fault-tolerant HSDP). All of it is the API's
setup object (:data:`~conformance.apis.fsdp2_replica.standalone.SETUP`), read by
:class:`~conformance.apis.fsdp2_common.models.Fsdp2Models`. Gradients and
parameters are compared as for every FSDP2 API: local shards (both are sharded
alike on the shard dimension), then full tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from conformance.apis.fsdp2_common.models import Fsdp2Models
from conformance.apis.fsdp2_common.registration import ALL_REDUCE_HOOK
from conformance.apis.fsdp2_common.registration_rules import registration_check
from conformance.apis.fsdp2_replica.arithmetic import ReplicaArithmetic
from conformance.apis.fsdp2_replica.recorder import ReplicaRecorder
from conformance.apis.fsdp2_replica.standalone import SETUP
from conformance.ranks.checks.models import Recorder

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

__all__ = ["ReplicaModels", "registration"]

#: ``fsdp2_replica.registration``: the registration rules of ``set_all_reduce_hook`` in this API's setting
#: (``config="replica"``): models under ``fully_shard`` on the ``shard`` dimension of the replicas x shards mesh
#: (a 1-D sub-mesh, where FSDP2 runs no all-reduce of its own), with ``functools.partial(spec.hook,
#: spec.state(replica_group))``, the object every check registers.
registration = registration_check(SETUP, ALL_REDUCE_HOOK)


class ReplicaModels(Fsdp2Models):
    """A replica all-reduce hook's models on a pool of ``replicas x shards`` ranks
    (:func:`~conformance.apis.fsdp2_common.setup.replica_shape`).

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

    setup = SETUP

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str = "replica", micro_steps: int = 1):
        super().__init__(ctx, spec, model=model, config=config, micro_steps=micro_steps)
        self.replica_group = self.mesh.get_group("replicate")
        self.arithmetic = ReplicaArithmetic(self.shape[0], spec.reduce_dtype)

    def recorder(self, hook: Callable[[torch.Tensor], object]) -> Recorder:
        return ReplicaRecorder(hook, self.ctx.rank, self.replica_group, self.shape)
