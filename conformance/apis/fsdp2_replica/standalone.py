"""The replica all-reduce hook's FSDP2 setup (torch only): ``FSDPModule.set_all_reduce_hook`` on a 1-D shard mesh,
where the hook is the whole reduction across replicas.

Its ``SETUP``, with the case's config alone, is written into every reproducer of an ``fsdp2_replica`` case,
after the FSDP2 part (``fsdp2_common/setup.py``, ``fsdp2_common/standalone.py``),
and the suite's models read the same object
(:class:`~conformance.apis.fsdp2_replica.models.ReplicaModels`). One config,
``replica``: the reference is native HSDP on the replicas x shards mesh
(:func:`~conformance.apis.fsdp2_common.setup.replica_shape`); the hooked model
shards on its ``shard`` dimension alone, and the hook, ``hook(state, tensor)``
with ``state = spec.state(replica_group)``, all-reduces across the replicas.
``all_reduce_off``, for accumulation: the hooked model under
``set_requires_all_reduce(False)`` on all micro-batches but the last, which does
not stop FSDP2 calling the hook on every one (torch 2.13, gloo:
``scripts/fsdp2_switches_evidence.py``); the reference is native HSDP
all-reducing every micro-batch (native HSDP with the same setter all-reduces
the accumulated sum once, another rounding).
"""

from __future__ import annotations

from typing import Any, Dict

from conformance.apis.fsdp2_common.setup import Fsdp2Config, Fsdp2Setup, bind_to_replicas, setup_constants

SETUP = Fsdp2Setup(setter="set_all_reduce_hook", bind=bind_to_replicas, configs={
    "replica": Fsdp2Config("native HSDP on the {mesh} mesh", mesh="replica", hooked_dim="shard"),
    "all_reduce_off": Fsdp2Config("native HSDP on the {mesh} mesh, all-reducing every micro-batch", mesh="replica",
                                  hooked_dim="shard", sync_setter="set_requires_all_reduce", sync_hooked_only=True),
})


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: this ``SETUP`` with the case's config alone
    (:func:`~conformance.apis.fsdp2_common.setup.setup_constants`)."""
    return setup_constants(SETUP, case)
