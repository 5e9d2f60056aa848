"""``fsdp2_replica.registration``: FSDP2's registration rules for a replica all-reduce hook.

The rules are FSDP2's (``conformance/apis/fsdp2/registration.py``), of
``FSDPModule.set_all_reduce_hook``, in this API's setting: models under
``fully_shard`` on the ``shard`` dimension of the pool's replicas x shards mesh
(a 1-D sub-mesh, where FSDP2 runs no all-reduce of its own), and the object the
suite registers for the spec, ``hook(state, tensor)`` bound to its state
``spec.state(replica_group)``.
"""

from __future__ import annotations

import functools
from typing import Any, List

from conformance.apis.fsdp2.build import mesh_for
from conformance.apis.fsdp2.registration import ALL_REDUCE_HOOK, check_rule
from conformance.apis.fsdp2_replica.models import replica_shape
from conformance.protocol import Finding


def registration(ctx: Any, spec: Any, *, config: str, rule: str) -> List[Finding]:
    """One rule of :data:`~conformance.apis.fsdp2.plan.REGISTRATION_RULES` (``config="replica"``) with
    ``functools.partial(spec.hook, spec.state(replica_group))`` on the replicas x shards mesh's ``shard``
    dimension (:func:`~conformance.apis.fsdp2_replica.models.replica_shape`).

    Raises:
        ValueError: an unknown rule; a pool that does not fit the mesh.
    """
    grid = mesh_for(ctx, replica_shape(ctx.world_size))
    hook = functools.partial(spec.hook, spec.state(grid.get_group("replicate")))
    return check_rule(ctx, spec, ALL_REDUCE_HOOK, grid["shard"], hook, rule)
