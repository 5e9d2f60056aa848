"""Hooks for the torchrun containment test: hang, pass, crash, then a case left for after the restarts.

Run in this order with ``torchrun --max-restarts 1``: the hang uses the one
restart and the next case passes on the restarted ranks; the crash needs a
second restart that torchrun no longer grants, so the last case must be
reported with that reason instead of waiting for ranks forever.
"""

from __future__ import annotations

from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook

from conformance.spec import HookSpec
from tests.zoo.contained import CRASH, GOOD, HANG

AFTER = HookSpec(name="zoo_after_the_restarts", api="fsdp", hook=allreduce_hook, state=DefaultState,
                 description="PyTorch's allreduce_hook, run after torchrun's restarts are exhausted")
ALL = [HANG, GOOD, CRASH, AFTER]
