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

import torch
from torch.distributed.algorithms._comm_hooks import default_hooks

from conformance.spec import HookSpec

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
]
