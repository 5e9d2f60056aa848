"""FSDP2 reference comms, as specs: the suite's default ``api="fsdp2"`` subjects.

:class:`PlainReduceScatter` is the project's known-good custom reduce-scatter for
``FSDPModule.set_custom_reduce_scatter``: the example to copy when writing a
comm. It is checked by default under three claims, one per reduce-dtype path
of FSDP2 (``_get_gradient_divide_factors`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``):

* ``plain_reduce_scatter``: full precision; FSDP2 passes ``ReduceOp.AVG``
  (``PREMUL_SUM(1/factor)`` with a divide factor, ``SUM`` when SUM is forced);
* ``plain_reduce_scatter_bf16``: ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``;
  the same ops, on bfloat16 buffers;
* ``plain_reduce_scatter_fp16``: ``MixedPrecisionPolicy(reduce_dtype=float16)``;
  FSDP2 passes ``ReduceOp.SUM`` and divides before and after the comm itself.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.distributed as dist

from conformance.apis.fsdp2.plan import NATIVE_MODES
from conformance.spec import HookSpec

try:  # torch >= 2.7; older torch has no custom comms (the checks skip there)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase  # optional
except ImportError:  # pragma: no cover - depends on the torch version
    _ReduceScatterBase = object  # type: ignore[assignment,misc]

__all__ = ["FSDP2_HOOKS", "PlainReduceScatter", "default_hook"]


class PlainReduceScatter(_ReduceScatterBase):  # type: ignore[misc,valid-type]
    """A custom FSDP2 reduce-scatter that reproduces the native one bit for bit. Copy this.

    Install it on **every** FSDP module (the setting does not recurse)::

        comm = PlainReduceScatter()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)

    What FSDP2 expects of a comm, and what this one does:

    * ``allocate(size, *, dtype, device)`` returns a tensor of exactly that
      size, dtype and device. FSDP2 allocates the flat reduce-scatter input
      (``world_size * shard_numel`` elements) and output (``shard_numel``) with
      it, and writes the gradients, already cast to the reduce dtype, into the
      input. A comm with a memory pool or registered buffers changes *where*
      the tensor lives, never its shape or dtype.
    * ``__call__(output_tensor, input_tensor, group, op, async_op=False)`` is
      called with those keyword names. It must reduce ``input_tensor`` over
      ``group`` (the shard group: a sub-group under HSDP, not the default
      group) with ``op``, and leave this rank's chunk in ``output_tensor``
      (chunk ``group.rank()``, in group order).
    * ``op`` carries the averaging, so pass it through: ``ReduceOp.AVG`` for
      float32/bfloat16, ``ReduceOp.PREMUL_SUM(1/factor)`` after
      ``set_gradient_divide_factor(factor)``, ``ReduceOp.SUM`` when FSDP2
      divides itself (float16, ``set_force_sum_reduction_for_comms(True)``).
      Replacing it (always SUM, always AVG, dividing by the group size
      yourself) breaks one of those paths.
    * FSDP2 ignores the return value and reads ``output_tensor`` right after
      the call (on CPU there is no stream to order it), so finish the
      collective before returning unless ``async_op=True`` was asked for.
    """

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Union[dist.ReduceOp, dist.ReduceOp.RedOpType], async_op: bool = False) -> Optional[Any]:
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


FSDP2_HOOKS = [
    # Each in both of FSDP2's natives (NATIVE_MODES): it passes on whatever op FSDP2 hands it, SUM included.
    HookSpec(name="plain_reduce_scatter", api="fsdp2", hook=PlainReduceScatter, native_modes=NATIVE_MODES,
             description="conformance.apis.fsdp2.builtin_hooks.PlainReduceScatter, full precision"),
    HookSpec(name="plain_reduce_scatter_bf16", api="fsdp2", hook=PlainReduceScatter, reduce_dtype=torch.bfloat16,
             native_modes=NATIVE_MODES,
             description="PlainReduceScatter under MixedPrecisionPolicy(reduce_dtype=bfloat16)"),
    HookSpec(name="plain_reduce_scatter_fp16", api="fsdp2", hook=PlainReduceScatter, reduce_dtype=torch.float16,
             native_modes=NATIVE_MODES,
             description="PlainReduceScatter under MixedPrecisionPolicy(reduce_dtype=float16): SUM, FSDP divides"),
    # torchtitan's default: the comm gets float32 gradients, the local sum of bfloat16 ones under accumulation
    # (FSDP2 accumulates in the reduce dtype, PyTorch PR 125191). A sample in the default run (sample_checks).
    HookSpec(name="plain_reduce_scatter_params_bf16", api="fsdp2", hook=PlainReduceScatter,
             param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             sample_checks=("fsdp2_parity", "fsdp2_accumulation"),
             description="PlainReduceScatter under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)"),
]


def default_hook(spec: HookSpec, params: Dict[str, Any], world_size: int) -> Optional[str]:
    """The name, in :data:`FSDP2_HOOKS`, of the comm that stands for FSDP2's own reduce-scatter in a case of
    ``spec`` (``ControllerSide.default_hook``): :class:`PlainReduceScatter` under the same reduce-dtype claim, which
    passes FSDP2's ``op`` through to ``reduce_scatter_tensor`` as the native path does."""
    if spec.param_dtype is not None:
        return ("plain_reduce_scatter_params_bf16"
                if (spec.param_dtype, spec.reduce_dtype) == (torch.bfloat16, torch.float32) else None)
    return {None: "plain_reduce_scatter", torch.bfloat16: "plain_reduce_scatter_bf16",
            torch.float16: "plain_reduce_scatter_fp16"}.get(spec.reduce_dtype)
