"""DDP's reference for each claim of a hook (a DDP extra): what ``api="ddp"`` hooks are compared against.

* full precision (``reduce_dtype=None``): DDP with no hook (``Reducer``: copy
  the gradient into the bucket divided by the world size, SUM all-reduce);
* ``reduce_dtype=float16`` / ``bfloat16``: ``fp16_compress_wrapper(allreduce_hook)``
  / ``bf16_compress_wrapper(allreduce_hook)``, which PyTorch documents as equal
  to ``fp16_compress_hook`` / ``bf16_compress_hook`` (``ddp_comm_hooks/default_hooks.py``);
* another reduce dtype: cast the bucket, ``allreduce_hook``, cast back.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from conformance.ranks.compare import dtype_name


def _identity_state(process_group: Any) -> Any:
    return process_group


class _CastAllreduce:
    """Cast the bucket to ``dtype``, ``allreduce_hook``, cast back: the ``*_compress_wrapper`` shape.

    Only for reduce dtypes PyTorch has no wrapper for (float32 / float64
    claims on parameters of another dtype).
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.__qualname__ = f"cast_allreduce_{dtype_name(dtype)}"

    def __call__(self, state: Any, bucket: Any) -> Any:
        out = bucket.buffer()
        bucket.set_buffer(out.to(self.dtype))
        fut = default_hooks.allreduce_hook(state, bucket)
        return fut.then(lambda f: out.copy_(f.value()))


def reference_hook(reduce_dtype: Optional[torch.dtype], param_dtype: torch.dtype
                   ) -> Optional[Tuple[Callable[[Any], Any], Any]]:
    """``(state_factory, hook)`` of the reference for a claim; ``None`` = DDP with no hook.

    ``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``
    for float16 / bfloat16, which PyTorch's docstrings state equal
    ``fp16_compress_hook`` / ``bf16_compress_hook``; ``allreduce_hook``'s
    state is the process group.
    """
    if reduce_dtype is None or reduce_dtype == param_dtype:
        return None
    if reduce_dtype == torch.float16:
        return _identity_state, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    if reduce_dtype == torch.bfloat16:
        return _identity_state, _renamed(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
                                         "reference_bf16_compress_wrapper_allreduce")
    return _identity_state, _CastAllreduce(reduce_dtype)


def _renamed(hook: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``hook`` under another ``__name__``.

    ``DistributedDataParallel._check_comm_hook`` refuses any hook *named*
    ``bf16_compress_hook`` or ``bf16_compress_wrapper_hook`` on a torch built
    without CUDA/NCCL, although gloo reduces bfloat16. The suite's own reference
    must run wherever the hook under test can, so it goes by another name; the
    arithmetic is PyTorch's, unchanged.
    """

    def reference(state, bucket):  # unannotated: DDP checks any annotation against GradBucket/Future
        return hook(state, bucket)

    reference.__name__ = reference.__qualname__ = name
    return reference


def reference_name(spec: Any) -> str:
    """What the hook is compared against, for messages."""
    if spec.reduce_dtype is None:
        return "DDP with no hook"
    if spec.reduce_dtype == torch.float16:
        return "the documented equivalent, fp16_compress_wrapper(allreduce_hook)"
    if spec.reduce_dtype == torch.bfloat16:
        return "the documented equivalent, bf16_compress_wrapper(allreduce_hook)"
    return f"allreduce_hook in {dtype_name(spec.reduce_dtype)}"
