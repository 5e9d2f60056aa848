"""DDP's reference for each claim of a hook (a DDP extra): what ``api="ddp"`` hooks are compared against.

* full precision (``reduce_dtype=None``): DDP with no hook (``Reducer``: copy
  the gradient into the bucket divided by the world size, SUM all-reduce);
* ``reduce_dtype=float16`` / ``bfloat16``: ``fp16_compress_wrapper(allreduce_hook)``
  / ``bf16_compress_wrapper(allreduce_hook)``, which PyTorch documents as equal
  to ``fp16_compress_hook`` / ``bf16_compress_hook`` (``ddp_comm_hooks/default_hooks.py``);
* another reduce dtype: cast the bucket, ``allreduce_hook``, cast back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec


def reference_name(spec: HookSpec) -> str:
    """What the hook is compared against, for messages (the model's claimed parameter dtype added by the
    caller)."""
    if spec.reduce_dtype is None or spec.reduce_dtype == getattr(spec, "param_dtype", None):
        return "DDP with no hook"
    if spec.reduce_dtype == torch.float16:
        return "the documented equivalent, fp16_compress_wrapper(allreduce_hook)"
    if spec.reduce_dtype == torch.bfloat16:
        return "the documented equivalent, bf16_compress_wrapper(allreduce_hook)"
    return f"allreduce_hook in {dtype_name(spec.reduce_dtype)}"
