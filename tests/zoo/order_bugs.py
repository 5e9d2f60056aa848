"""The zoos' rounding-order, division-order and shard-order bugs, for the redundancy meta-test at 3 ranks.

Most are right at 2 and 4 ranks, where every division by the world size is by a power of
two; a world size that is not a power of two shows them. ``tests/test_redundancy.py`` requires every one of them to be caught by at
least two independent cases (a different check, config or model) at 3 ranks, so that no
single case stands between such a hook and a verdict of CONFORMS.

Specs are renamed ``<api>_<name>``: the zoos reuse names across APIs.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from conformance.spec import HookSpec
from tests.zoo import ddp_hooks, fsdp2_comms, fsdp_hooks

#: Zoo spec names per API, and the class of bug each stands for.
CLASSES: Dict[str, Dict[str, str]] = {
    "fsdp": {
        "bad_sum_then_divide": "division order: SUM before any divide overflows where FSDP's pre-divide does not",
        "bad_power_of_two_divisor": "rounding order: divides by the next power of two",
        "bad_wrong_shard": "shard order: the output gets the neighbour's shard",
    },
    "ddp": {
        "bad_divides_by_world_size": "rounding order: x / world_size where DDP multiplies by 1/world_size",
    },
    "fsdp2": {
        "bad_self_average": "rounding order: SUM then / group size, where FSDP2 passes SUM and divides itself",
        "bad_self_average_fp16": "rounding order: the same under a float16 claim",
        "bad_wrong_shard": "shard order: every rank's shard holds its neighbour's values",
    },
}

_ZOOS = {"fsdp": fsdp_hooks.ALL, "ddp": ddp_hooks.ALL, "fsdp2": fsdp2_comms.ALL}

def _renamed(spec: HookSpec, api: str) -> HookSpec:
    # A validated spec holds its resolved strategies; only api="fsdp" may pass them back in.
    return dataclasses.replace(spec, name=f"{api}_{spec.name}", **({} if api == "fsdp" else {"strategies": None}))


ORDER_BUGS: List[HookSpec] = [_renamed(spec, api) for api, names in CLASSES.items() for spec in _ZOOS[api]
                              if spec.name in names]
