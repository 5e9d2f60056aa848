"""PyTorch's own FSDP communication hooks, as specs: the suite's default subjects.

From ``torch.distributed.algorithms._comm_hooks.default_hooks``:

* ``allreduce_hook`` (``NO_SHARD``) and ``reduce_scatter_hook`` (sharded),
  with ``DefaultState``: claim full-precision default averaging;
* ``fp16_compress_hook`` / ``bf16_compress_hook`` with ``LowPrecisionState``:
  claim ``MixedPrecision(reduce_dtype=float16 / bfloat16)``.

On CPU the compress hooks raise inside ``_decompress`` (``record_stream`` on a
CPU tensor); ``fixtures/known_failures.toml`` records that as a finding.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.distributed.algorithms._comm_hooks import default_hooks

from conformance.spec import HookSpec

#: The checks the built-in hooks' parameter-dtype claims get in the default run (``HookSpec.sample_checks``).
PARAM_DTYPE_SAMPLE = ("parity", "accumulation")

FSDP_HOOKS = [
    HookSpec(name="allreduce_hook", api="fsdp", hook=default_hooks.allreduce_hook,
             state=default_hooks.DefaultState,
             description="default_hooks.allreduce_hook with DefaultState (NO_SHARD)"),
    HookSpec(name="reduce_scatter_hook", api="fsdp", hook=default_hooks.reduce_scatter_hook,
             state=default_hooks.DefaultState,
             description="default_hooks.reduce_scatter_hook with DefaultState (sharded)"),
    HookSpec(name="fp16_compress_hook", api="fsdp", hook=default_hooks.fp16_compress_hook,
             state=default_hooks.LowPrecisionState, reduce_dtype=torch.float16,
             description="default_hooks.fp16_compress_hook with LowPrecisionState"),
    HookSpec(name="bf16_compress_hook", api="fsdp", hook=default_hooks.bf16_compress_hook,
             state=default_hooks.LowPrecisionState, reduce_dtype=torch.bfloat16,
             description="default_hooks.bf16_compress_hook with LowPrecisionState"),
    # torchtitan's setting, bfloat16 parameters reduced in float32: FSDP hands the hook float32 gradients (gloo,
    # torch 2.13 CPU: bitwise native with no_sync() accumulation). A sample in the default run (sample_checks).
    HookSpec(name="allreduce_hook_params_bf16", api="fsdp", hook=default_hooks.allreduce_hook,
             state=default_hooks.DefaultState, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             sample_checks=PARAM_DTYPE_SAMPLE,
             description="allreduce_hook under MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)"),
    HookSpec(name="reduce_scatter_hook_params_bf16", api="fsdp", hook=default_hooks.reduce_scatter_hook,
             state=default_hooks.DefaultState, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
             sample_checks=PARAM_DTYPE_SAMPLE,
             description="reduce_scatter_hook under MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)"),
]


def default_hook(spec: HookSpec, params: Dict[str, Any], world_size: int) -> Optional[str]:
    """The name, in :data:`FSDP_HOOKS`, of PyTorch's own hook for a case of ``spec`` (``ControllerSide.default_hook``).

    ``params`` are the rank check's (``strategy``, ``low_precision_grads``).
    ``allreduce_hook`` under ``NO_SHARD`` and ``reduce_scatter_hook`` under the
    sharded strategies, with ``DefaultState``, do what FSDP's native path does
    (``_reduce_grad_no_shard`` / ``_reduce_grad``: pre-divide, SUM, post-divide)
    in the dtype the gradient arrives in, so they stand for a full-precision
    claim, and for the float16 gradients of ``low_precision_grads`` whatever
    the claim. A ``reduce_dtype=X`` claim gets the compress hook of X (which
    raises on CPU: no evidence there, and the failure stands).
    """
    if spec.param_dtype is not None and not params.get("low_precision_grads"):
        if (spec.param_dtype, spec.reduce_dtype) != (torch.bfloat16, torch.float32):
            return None  # no built-in hook under this claim
        sharded = params.get("strategy") != "NO_SHARD"
        return "reduce_scatter_hook_params_bf16" if sharded else "allreduce_hook_params_bf16"
    if spec.reduce_dtype is None or params.get("low_precision_grads"):
        return "allreduce_hook" if params.get("strategy") == "NO_SHARD" else "reduce_scatter_hook"
    return {torch.float16: "fp16_compress_hook", torch.bfloat16: "bf16_compress_hook"}.get(spec.reduce_dtype)
