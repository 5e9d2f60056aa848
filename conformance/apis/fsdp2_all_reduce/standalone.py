"""The all-reduce hook's FSDP2 setup (torch only): ``FSDPModule.set_all_reduce_hook(hook)`` where FSDP2 calls it
after its own all-reduce.

Its ``SETUP``, with the case's config alone, is written into every reproducer of an ``fsdp2_all_reduce``
case, after the FSDP2 part (``fsdp2_common/setup.py``,
``fsdp2_common/standalone.py``), and the suite's models read the same object
(:class:`~conformance.apis.fsdp2_all_reduce.models.AllReduceHookModels`).
Configs: ``hsdp`` (native HSDP on a 2-D replicate x shard mesh),
``replicate`` (``replicate`` on FSDP2: its default AVG) and ``replicate_sum``
(``set_gradient_divide_factor(1.0)``: a SUM, torchtitan's default); in each,
accumulation turns off the all-reduce alone (``set_requires_all_reduce``).
"""

from __future__ import annotations

from typing import Any, Dict

from conformance.apis.fsdp2_common.setup import Fsdp2Config, Fsdp2Setup, bind_hook, no_division, setup_constants

_ALL_REDUCE_OFF = "set_requires_all_reduce"

SETUP = Fsdp2Setup(setter="set_all_reduce_hook", bind=bind_hook, configs={
    "hsdp": Fsdp2Config("native HSDP without the hook", mesh="hsdp", sync_setter=_ALL_REDUCE_OFF),
    "replicate": Fsdp2Config("replicate (on FSDP2) without the hook", mesh="replicate", sync_setter=_ALL_REDUCE_OFF),
    "replicate_sum": Fsdp2Config("replicate (on FSDP2) without the hook, set_gradient_divide_factor(1.0)",
                                 mesh="replicate", divide_factor=no_division, sync_setter=_ALL_REDUCE_OFF),
})


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: this ``SETUP`` with the case's config alone
    (:func:`~conformance.apis.fsdp2_common.setup.setup_constants`)."""
    return setup_constants(SETUP, case)
