"""A zoo of FSDP2 custom reduce-scatter comms and all-reduce hooks: known-good and known-bad.

The FSDP2 meta-test runs the suite's ``test_fsdp2_*`` checks over these. Each known-good
spec must pass every case; each known-bad spec must be caught, and ``EXPECTED_CATCH`` says
by which config and why no weaker one can.

What "good" means is fixed by FSDP2 itself (``foreach_reduce`` and
``_get_gradient_divide_factors`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``):
FSDP2 allocates the flat buffers with ``comm.allocate(size, dtype=reduce_dtype, device=...)``,
copies the (pre-divided, for float16) gradients in, and calls
``comm(output_tensor=..., input_tensor=..., group=<shard group>, op=<op>)``, where ``op`` is
``AVG`` (float32/bfloat16), ``PREMUL_SUM(1/factor)`` (float32/bfloat16 with a divide factor) or
``SUM`` (float16, or forced SUM; FSDP2 divides itself). The sharded gradients FSDP2 hands the
optimizer are views into the comm's output buffer.

``NCCL_ONLY_BAD`` holds bad comms whose only failing path is ``PREMUL_SUM``, which gloo
cannot run natively: on gloo the suite skips those cases and says why.
The zoo is one module per kind of hook, each holding its hooks, their ``HookSpec`` s and, for the bad ones,
the config that must catch each: ``reduce_scatter.py`` (reduce-scatter comms, with ``NCCL_ONLY_BAD`` and
``THREE_RANK_BAD``), ``allocation.py`` (comms whose ``allocate`` is wrong), ``all_reduce.py`` (all-reduce hooks),
``replica.py`` (replica hooks) and ``lossy.py`` (``LOSSY``, the lossy-contract story, run by
``tests/test_meta_lossy.py``, not by the exact zoo run). This module gathers them (``KNOWN_GOOD``, ``KNOWN_BAD``,
``ALL``, ``EXPECTED_CATCH``); specs are named by its path, ``tests.zoo.fsdp2_comms:ALL``.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

from conformance.spec import HookSpec
from tests.zoo.fsdp2_comms import all_reduce, allocation, reduce_scatter, replica
from tests.zoo.fsdp2_comms.all_reduce import unit_scale_hook  # noqa: F401 (read by tests/test_fsdp2_registration.py)
from tests.zoo.fsdp2_comms.lossy import LOSSY, LOSSY_BAD, LOSSY_EXPECTED, LOSSY_GOOD, Int8Comm  # noqa: F401
from tests.zoo.fsdp2_comms.reduce_scatter import NCCL_ONLY_BAD, THREE_RANK_BAD, THREE_RANK_EXPECTED
# Read by tests/zoo/fixed_twins.py and tests/zoo/param_dtype_hooks.py, which import them from here.
from tests.zoo.fsdp2_comms.reduce_scatter import Bf16WireComm, StaleReplayComm  # noqa: F401
from tests.zoo.plain_hooks import Alloc as _Alloc  # noqa: F401
from tests.zoo.plain_hooks import comm_reduce_scatter as _reduce_scatter  # noqa: F401

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "LOSSY", "LOSSY_EXPECTED", "NCCL_ONLY_BAD",
           "THREE_RANK_BAD", "THREE_RANK_EXPECTED"]

KNOWN_GOOD: List[HookSpec] = reduce_scatter.KNOWN_GOOD + all_reduce.KNOWN_GOOD + replica.KNOWN_GOOD

_BAD = {spec.name: spec for spec in
        reduce_scatter.KNOWN_BAD + allocation.KNOWN_BAD + all_reduce.KNOWN_BAD + replica.KNOWN_BAD}
#: The order the suite runs the known-bad hooks in: the order of the one module this package was split from.
_BAD_ORDER = (
    "bad_always_sum",
    "bad_self_average",
    "bad_self_average_fp16",
    "bad_wrong_shard",
    "bad_default_group",
    "bad_fp32_alloc_bf16",
    "bad_padded_alloc",
    "bad_bf16_wire",
    "bad_staging_buffer",
    "bad_stale_replay",
    "bad_rank0_noise",
    "bad_world_average_hook",
    "bad_replica_divide_hook",
    "bad_replica_sum",
    "bad_replica_world_divisor",
    "bad_replica_divide_then_sum",
    "bad_replica_default_group",
    "bad_replica_out_of_place",
    "bad_nan_to_zero",
    "bad_nan_to_zero_hook",
    "bad_world_size_average",
)
assert set(_BAD_ORDER) == set(_BAD), "every known-bad FSDP2 hook is named once in _BAD_ORDER"

KNOWN_BAD: List[HookSpec] = [_BAD[name] for name in _BAD_ORDER]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD + NCCL_ONLY_BAD

#: For each known-bad spec, the config that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {**reduce_scatter.EXPECTED_CATCH, **allocation.EXPECTED_CATCH,
                                  **all_reduce.EXPECTED_CATCH, **replica.EXPECTED_CATCH}
