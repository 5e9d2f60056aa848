"""The reduce-scatter comm's FSDP2 setup (torch only): ``FSDPModule.set_custom_reduce_scatter(comm)``.

Its ``SETUP``, with the case's config alone, is written into every reproducer of an ``fsdp2`` case, after the
FSDP2 part (``fsdp2_common/setup.py``, ``fsdp2_common/standalone.py``), and the
suite's models read the same object (:class:`~conformance.apis.fsdp2.models.CommModels`).
The configs decide the ``op`` FSDP2 hands the comm: ``default`` (nothing set:
AVG for float32/bfloat16), ``divide_factor`` (``set_gradient_divide_factor``
on every FSDP module), ``force_sum`` (``set_force_sum_reduction_for_comms(True)``),
both, ``divide_factor_some`` (the factor on the root alone: the others keep
FSDP2's own average, PyTorch issue 157485); ``hsdp`` and ``hsdp_divide_factor``
on a 2-D (replicate x shard) mesh, where the divide factor must divide the SUM
over every rank as the flattened 1-D mesh does (PyTorch issue 155903);
``subgroup`` (a 1-D mesh over this rank's data-parallel subgroup, not WORLD);
``replicate`` (``replicate`` on FSDP2, where FSDP2 allocates through the comm
but never calls it); ``unused_params`` (``set_reduce_scatter_unused_params(True)``:
torch 2.13, gloo: the comm's input holds zeros for a parameter the forward did
not use (``scripts/fsdp2_switches_evidence.py``: 144 elements with 72 zeros
where 72 otherwise), and that parameter's gradient is zeros, not ``None``); ``sum_no_divide``
(``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)``: FSDP2 hands the comm
``SUM`` and divides nothing, the native a framework that scales its gradients itself runs, and a comm that
accepts only ``SUM`` is written for: ``HookSpec(native_modes=("sum_no_divide",))``).
"""

from __future__ import annotations

from typing import Any, Dict

from conformance.apis.fsdp2_common.setup import (Fsdp2Config, Fsdp2Setup, bind_comm, divide_factor, no_division,
                                                setup_constants)

_HSDP = dict(mesh="hsdp", sync_setter="set_requires_all_reduce")

SETUP = Fsdp2Setup(setter="set_custom_reduce_scatter", bind=bind_comm, comm_kind="ReduceScatter", configs={
    "default": Fsdp2Config("native fully_shard"),
    "divide_factor": Fsdp2Config("native fully_shard", divide_factor=divide_factor),
    "force_sum": Fsdp2Config("native fully_shard", force_sum=True),
    "divide_factor_force_sum": Fsdp2Config("native fully_shard", divide_factor=divide_factor, force_sum=True),
    "divide_factor_some": Fsdp2Config("native fully_shard", divide_factor=divide_factor, divide_root_only=True),
    "hsdp": Fsdp2Config("native fully_shard", **_HSDP),
    "hsdp_divide_factor": Fsdp2Config("native fully_shard", divide_factor=divide_factor, **_HSDP),
    "subgroup": Fsdp2Config("native fully_shard", mesh="subgroup"),
    "replicate": Fsdp2Config("replicate (on FSDP2) without the comm", mesh="replicate"),
    "unused_params": Fsdp2Config("native fully_shard with set_reduce_scatter_unused_params(True)",
                                 setters=(("set_reduce_scatter_unused_params", True),)),
    "sum_no_divide": Fsdp2Config("native fully_shard with set_gradient_divide_factor(1.0) and "
                                 "set_force_sum_reduction_for_comms(True)", divide_factor=no_division, force_sum=True),
})


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: this ``SETUP`` with the case's config alone
    (:func:`~conformance.apis.fsdp2_common.setup.setup_constants`)."""
    return setup_constants(SETUP, case)
