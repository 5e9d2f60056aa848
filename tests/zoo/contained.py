"""Hooks that hang or kill a rank, for the containment tests.

They break the pool on purpose: the suite must time the case out (or notice
the dead rank), report what every rank was doing, restart the pool and go on.
Both are NO_SHARD-only and misbehave on rank 1 only, as a real bug usually
does: rank 0 is then left blocked in the collective its peer never joins.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook

from conformance.spec import HookSpec


def hang_on_rank1(state, grad):
    """Rank 1 sleeps instead of reducing; rank 0 waits for it in all_reduce."""
    if dist.get_rank(state.process_group) == 1:
        time.sleep(3600)
    allreduce_hook(state, grad)


def crash_on_rank1(state, grad):
    """Rank 1's process exits in the middle of backward."""
    if dist.get_rank(state.process_group) == 1:
        os._exit(17)
    allreduce_hook(state, grad)


HANG = HookSpec(name="zoo_hang_rank1", api="fsdp", hook=hang_on_rank1, state=DefaultState,
                description="rank 1 never joins the all-reduce")
CRASH = HookSpec(name="zoo_crash_rank1", api="fsdp", hook=crash_on_rank1, state=DefaultState,
                 description="rank 1 exits during backward")
GOOD = HookSpec(name="zoo_plain_allreduce", api="fsdp", hook=allreduce_hook, state=DefaultState,
                description="PyTorch's allreduce_hook, to show the run goes on")
ALL = [HANG, CRASH, GOOD]
