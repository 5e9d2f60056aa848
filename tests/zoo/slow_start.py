"""A correct hook whose module takes long to import inside a rank: for stopping a run while its pools start.

Inside a rank (``CONFORM_RANK`` is set there, not in the controller), importing
this module creates ``$CONFORM_TEST_RANK_STARTING.rank<r>`` when that variable
is set; on every rank but 0 it then sleeps ``CONFORM_TEST_START_DELAY_S`` seconds
(default 120): the pool is still starting while the tests signal the controller.
Rank 0 imports it at once, so the one-rank preflight that loads every spec before
the run (``Runner.check_specs``) does not wait for the delay.
"""

from __future__ import annotations

import os
import time

from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook

from conformance.spec import HookSpec

if os.environ.get("CONFORM_RANK") is not None:
    _marker = os.environ.get("CONFORM_TEST_RANK_STARTING")
    if _marker:
        open(f"{_marker}.rank{os.environ['CONFORM_RANK']}", "w").close()
    if os.environ["CONFORM_RANK"] != "0":
        time.sleep(float(os.environ.get("CONFORM_TEST_START_DELAY_S", "120")))

SPEC = HookSpec(name="zoo_slow_start", api="fsdp", hook=allreduce_hook, state=DefaultState,
                description="PyTorch's allreduce_hook, from a module slow to import inside a rank")
