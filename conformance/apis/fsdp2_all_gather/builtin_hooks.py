"""FSDP2's own all-gather, as a comm spec: the suite's default ``api="fsdp2_all_gather"`` subject.

:class:`PlainAllGather` is the project's known-good custom all-gather for
``FSDPModule.set_custom_all_gather``: what FSDP2's ``DefaultAllGather``
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) does, written as
a user would. The example to copy when writing an all-gather comm.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from conformance.spec import HookSpec

try:  # torch >= 2.9; older torch has no custom all-gather (the checks skip there)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase  # optional
except ImportError:  # pragma: no cover - depends on the torch version
    _AllGatherBase = object  # type: ignore[assignment,misc]

__all__ = ["FSDP2_ALL_GATHER_HOOKS", "PlainAllGather", "default_hook"]


class PlainAllGather(_AllGatherBase):  # type: ignore[misc,valid-type]
    """A custom FSDP2 all-gather that reproduces the native one bit for bit. Copy this.

    Install it on **every** FSDP module (the setting does not recurse)::

        comm = PlainAllGather()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(comm)

    What FSDP2 expects of a comm, and what this one does:

    * ``allocate(size, *, dtype, device)`` returns a tensor of exactly that size
      (``(group_size * shard_numel,)``), dtype (the parameter dtype: ``param_dtype``
      of ``MixedPrecisionPolicy``, else the parameters' own) and device. FSDP2
      copies this rank's flat shard into its chunk of it and reads the unsharded
      parameters out of it after the call.
    * ``__call__(output_tensor, input_tensor, group, async_op=False)`` is called
      with those keyword names, once per FSDP unit in the forward and again in
      the backward where the unit resharded after the forward.
      ``input_tensor`` is this rank's flat shard (a view of its chunk of
      ``output_tensor``); the comm must leave the shards of ``group`` (the shard
      group: a sub-group under HSDP or on a sub-mesh, not the default group) in
      ``output_tensor``, chunk r from rank r of the group, bit for bit.
    * FSDP2 waits on a ``Work`` the comm returns (even with ``async_op=False``);
      a comm that launches a collective asynchronously must return its ``Work``
      or wait on it before returning.
    """

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[Any]:
        # torch 2.13 renames all_gather_into_tensor (deprecated there, a FutureWarning per call) all_gather_single
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


FSDP2_ALL_GATHER_HOOKS = [
    HookSpec(name="plain_all_gather", api="fsdp2_all_gather", hook=PlainAllGather,
             description="conformance.apis.fsdp2_all_gather.builtin_hooks.PlainAllGather (FSDP2's DefaultAllGather)"),
    # torchtitan's default parameter dtype: the comm gathers bfloat16 shards (an all-gather takes no reduce dtype).
    # A sample in the default run (sample_checks).
    HookSpec(name="plain_all_gather_params_bf16", api="fsdp2_all_gather", hook=PlainAllGather,
             param_dtype=torch.bfloat16, sample_checks=("fsdp2_all_gather_parity",),
             description="PlainAllGather under MixedPrecisionPolicy(param_dtype=bfloat16)"),
]


def default_hook(spec: HookSpec, params: Dict[str, Any], world_size: int) -> Optional[str]:
    """The name, in :data:`FSDP2_ALL_GATHER_HOOKS`, of the comm that stands for FSDP2's own all-gather in a case
    of ``spec`` (``ControllerSide.default_hook``): :class:`PlainAllGather`, which calls ``all_gather_single``
    (before torch 2.13 ``all_gather_into_tensor``) as ``DefaultAllGather`` does; under a claimed parameter dtype,
    the bfloat16-parameter sample."""
    if spec.param_dtype is not None:
        return "plain_all_gather_params_bf16" if spec.param_dtype == torch.bfloat16 else None
    return "plain_all_gather"
