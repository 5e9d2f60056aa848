"""The all-gather comm's FSDP2 setup (torch only): ``FSDPModule.set_custom_all_gather(comm)``.

Its ``SETUP``, with the case's config alone, is written into every reproducer of an ``fsdp2_all_gather`` case,
after the FSDP2 part (``fsdp2_common/setup.py``, ``fsdp2_common/standalone.py``),
and the suite's models read the same object
(:class:`~conformance.apis.fsdp2_all_gather.models.AllGatherModels`). FSDP2 calls
the comm once per FSDP unit in the forward and again in the backward where it
resharded after the forward (torch 2.13, gloo: 6 calls a step for 3 units where every one reshards).
Configs: ``default`` (a 1-D mesh over the pool, ``reshard_after_forward`` left to FSDP2: every unit but the
root re-gathers in the backward, 5 calls a step for 3 units), ``no_reshard``
(``reshard_after_forward=False``: no re-gather in the backward, 3 calls), ``reshard_root``
(``set_reshard_after_forward(True)`` once built: the root re-gathers too, 6 calls; the setter gives what the
constructor argument gives, True or False, and differs from leaving it to FSDP2),
``hsdp`` (a 2-D replicate x shard mesh: the comm gathers over the shard group)
and ``subgroup`` (a 1-D mesh over this rank's data-parallel subgroup, {0,2} and
{1,3} of 4 ranks: a comm that gathers over the default group is wrong there).
"""

from __future__ import annotations

from typing import Any, Dict

from conformance.apis.fsdp2_common.setup import Fsdp2Config, Fsdp2Setup, bind_comm, setup_constants

SETUP = Fsdp2Setup(setter="set_custom_all_gather", bind=bind_comm, comm_kind="AllGather", configs={
    "default": Fsdp2Config("native fully_shard"),
    "no_reshard": Fsdp2Config("native fully_shard(reshard_after_forward=False)", reshard_after_forward=False),
    "reshard_root": Fsdp2Config("native fully_shard, then set_reshard_after_forward(True)",
                                setters=(("set_reshard_after_forward", True),)),
    "hsdp": Fsdp2Config("native HSDP ({mesh} mesh)", mesh="hsdp"),
    "subgroup": Fsdp2Config("native fully_shard on the data-parallel subgroup", mesh="subgroup"),
})


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: this ``SETUP`` with the case's config alone
    (:func:`~conformance.apis.fsdp2_common.setup.setup_constants`)."""
    return setup_constants(SETUP, case)
