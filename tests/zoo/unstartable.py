"""A hook module that ends every rank process that imports it (not the controller): its pool can never
start. The run must report its hook NOT RUN, exit with RUN_ERROR, and still check the other hooks."""

from __future__ import annotations

import os

from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook

from conformance.spec import HookSpec

if os.environ.get("CONFORM_RANK") is not None:
    os._exit(3)

SPEC = HookSpec(name="zoo_unstartable", api="fsdp", hook=allreduce_hook, state=DefaultState,
                strategies=("NO_SHARD",), description="every rank that imports its module exits")
