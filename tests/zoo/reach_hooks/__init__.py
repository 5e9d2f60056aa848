"""A zoo of hooks whose bugs lie past the suite's small, short, one-node cases (issue 28): known-good and known-bad.

Real hooks switch code paths on three axes the small cases never touch, and each
hook here switches on one of them:

* **size**: a path taken only above a buffer size (a DDP bucket, an FSDP1 flat
  gradient, an FSDP2 reduce-scatter input, a replica tensor): a chunk loop that
  drops the tail, "large buffers go low precision", an async launch whose ``Work``
  nobody waits for. The good twins stage large buffers through persistent
  buffers: another path, the same arithmetic. None of them chunks an all-reduce
  or a reduce-scatter: on gloo at 3 ranks a chunked all-reduce sums in another
  order than one all-reduce of the whole buffer, so a chunk loop is never bitwise
  native there, tail or no tail;
* **horizon**: a path taken only after many steps, counted as a hook can (a step
  counter that advances on the last bucket, as PowerSGD's ``maybe_increase_iter``
  does, or a call count per FSDP unit, keyed by the unit's gradient size): a
  warm-up that ends in a wrong path, communication skipping that reuses the last
  result, a periodic probe that writes into the result (on every rank, or on rank 0
  alone), a 7-bit/6-bit sequence
  number whose reply table is never evicted. The good twins end their warm-up in
  another implementation of the same arithmetic. Every threshold is at step 10 or
  later (0-based), and under 200;
* **topology**: a path taken only when the environment torchrun sets says the job
  spans several nodes (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_RANK``; absent,
  one node is assumed): a divisor read from ``LOCAL_WORLD_SIZE``, a two-level
  reduction over the wrong groups or averaged twice, bfloat16 on the inter-node
  link. The good twins take an async or staged path across nodes, with the same
  arithmetic. Hooks that build process groups build them in the state factory,
  collectively, the same on every rank, and only where the state's process group
  spans the whole world (a subgroup keeps the one-node path).

``REACH`` says, for every hook, its axis and where its threshold lies, in a form a
meta-test or ``scripts/reach_zoo_evidence.py`` (which establishes each verdict
outside the suite) can use: ``numel`` (size: the buffer elements at or above which
the other path runs, and ``buffer``, which buffer), ``first_step`` (horizon: the
0-based step whose gradients differ first, on a model whose FSDP units all differ
in size, in DDP's default config), ``layouts`` (topology: the ``nodes x
ranks-per-node`` layouts on which a bad hook differs; on the others it is native).
DDP's first iteration runs with one bucket for the whole model (measured: 7,057,750
elements, then 6,553,625 and 504,125 from step 1 on), so a 1-4 MiB bucket exists
only from step 1, and in configs whose buckets are rebuilt after step 0 a reply
table keyed at step 0 may first replay a step later.

Units of the same gradient size share one call counter (an FSDP hook sees no unit
identity), so on a model with ``k`` units of one size an FSDP horizon threshold
arrives ``k`` times sooner; the smallest FSDP threshold here is step 15, still
past the suite's four-step cases with up to 3 such units.

The zoo is one module per API, each holding its hooks by axis and their ``HookSpec`` s: ``ddp.py``,
``fsdp.py`` (FSDP1), ``fsdp2.py`` (FSDP2 reduce-scatter comms) and ``replica.py`` (FSDP2 replica hooks), over
the helpers they share (``common.py``). This module gathers their specs (``KNOWN_GOOD``, ``KNOWN_BAD``, ``ALL``:
the order the suite runs them) and holds ``REACH`` and ``EXPECTED_CATCH``; specs are named by this module's path,
``tests.zoo.reach_hooks:ALL``.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the
suite's ``HookSpec``, as every zoo): the zoo is imported by the controller and by
every rank process.
"""

from typing import Any, Dict, List

from conformance.spec import HookSpec
from tests.zoo.reach_hooks import ddp, fsdp, fsdp2, replica
from tests.zoo.reach_hooks.common import topology
from tests.zoo.reach_hooks.ddp import DDP_BF16_NUMEL, DDP_CHUNK_NUMEL, DDP_STAGE_NUMEL
from tests.zoo.reach_hooks.fsdp import FSDP_CHUNK_NUMEL, FSDP_FP16_NUMEL, FSDP_POOL_NUMEL
from tests.zoo.reach_hooks.fsdp2 import FSDP2_ASYNC_NUMEL, FSDP2_CHUNK_ABOVE, FSDP2_STAGE_NUMEL
from tests.zoo.reach_hooks.replica import REPLICA_BF16_NUMEL, REPLICA_CHUNK_ABOVE, REPLICA_STAGE_NUMEL

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "REACH", "topology"]

KNOWN_GOOD: List[HookSpec] = ddp.KNOWN_GOOD + fsdp.KNOWN_GOOD + fsdp2.KNOWN_GOOD + replica.KNOWN_GOOD
KNOWN_BAD: List[HookSpec] = ddp.KNOWN_BAD + fsdp.KNOWN_BAD + fsdp2.KNOWN_BAD + replica.KNOWN_BAD

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: Where each hook's other path starts. ``axis``: "size", "horizon" or "topology". Size: ``numel``, the elements at
#: or above which the other path runs (strictly above for the chunk loops), and ``buffer``, which buffer. Horizon:
#: ``first_step``, the 0-based step whose gradients differ first (for a good hook: the step its other path starts).
#: Topology: ``layouts``, the ``"nodes x ranks-per-node"`` layouts on which a bad hook differs from native (a good one
#: takes its other path on every multi-node layout).
REACH: Dict[str, Dict[str, Any]] = {
    "good_ddp_staged_large": {"axis": "size", "numel": DDP_STAGE_NUMEL, "buffer": "DDP bucket"},
    "bad_ddp_chunked_drops_tail": {"axis": "size", "numel": DDP_CHUNK_NUMEL, "buffer": "DDP bucket"},
    "bad_ddp_large_bucket_bf16": {"axis": "size", "numel": DDP_BF16_NUMEL, "buffer": "DDP bucket"},
    "good_fsdp_pooled_output": {"axis": "size", "numel": FSDP_POOL_NUMEL, "buffer": "FSDP1 result (shard)"},
    "bad_fsdp_chunked_drops_tail": {"axis": "size", "numel": FSDP_CHUNK_NUMEL, "buffer": "FSDP1 result (shard)"},
    "bad_fsdp_large_fp16": {"axis": "size", "numel": FSDP_FP16_NUMEL, "buffer": "FSDP1 flat gradient"},
    "good_fsdp2_staged_large": {"axis": "size", "numel": FSDP2_STAGE_NUMEL, "buffer": "FSDP2 reduce-scatter input"},
    "bad_fsdp2_async_unwaited": {"axis": "size", "numel": FSDP2_ASYNC_NUMEL, "buffer": "FSDP2 reduce-scatter input"},
    "bad_fsdp2_chunked_drops_tail": {"axis": "size", "numel": FSDP2_CHUNK_ABOVE,
                                     "buffer": "FSDP2 reduce-scatter input"},
    "good_replica_staged_large": {"axis": "size", "numel": REPLICA_STAGE_NUMEL, "buffer": "replica tensor"},
    "bad_replica_chunked_drops_tail": {"axis": "size", "numel": REPLICA_CHUNK_ABOVE, "buffer": "replica tensor"},
    "bad_replica_large_bf16": {"axis": "size", "numel": REPLICA_BF16_NUMEL, "buffer": "replica tensor"},
    "good_ddp_warmup_switch": {"axis": "horizon", "first_step": 20},
    "bad_ddp_warmup_fp16": {"axis": "horizon", "first_step": 10},
    "bad_ddp_skip_every_k": {"axis": "horizon", "first_step": 36},
    "bad_ddp_noise_probe": {"axis": "horizon", "first_step": 100},
    "bad_ddp_reply_table_wraps": {"axis": "horizon", "first_step": 128},
    "bad_ddp_rank0_norm_probe": {"axis": "horizon", "first_step": 40},
    "good_fsdp_warmup_switch": {"axis": "horizon", "first_step": 25},
    "bad_fsdp_warmup_bf16": {"axis": "horizon", "first_step": 150},
    "bad_fsdp_skip_every_k": {"axis": "horizon", "first_step": 15},
    "bad_fsdp_noise_probe": {"axis": "horizon", "first_step": 50},
    "good_fsdp2_warmup_switch": {"axis": "horizon", "first_step": 30},
    "bad_fsdp2_warmup_bf16": {"axis": "horizon", "first_step": 90},
    "bad_fsdp2_reply_table_wraps": {"axis": "horizon", "first_step": 64},
    "good_replica_warmup_switch": {"axis": "horizon", "first_step": 12},
    "bad_replica_local_sgd": {"axis": "horizon", "first_step": 45},
    "bad_replica_noise_probe": {"axis": "horizon", "first_step": 75},
    "good_ddp_topology_async": {"axis": "topology", "layouts": ()},
    "bad_ddp_local_world_divisor": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_ddp_two_level_transposed": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "good_fsdp_topology_async": {"axis": "topology", "layouts": ()},
    "bad_fsdp_node_factors": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_fsdp_two_level_avg_twice": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "bad_fsdp_two_level_divides_grad": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "good_fsdp2_topology_staged": {"axis": "topology", "layouts": ()},
    "bad_fsdp2_local_world_avg": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "bad_fsdp2_cross_node_bf16": {"axis": "topology", "layouts": ("2x1", "2x2", "2x4")},
    "good_replica_topology_async": {"axis": "topology", "layouts": ()},
    "bad_replica_local_divisor": {"axis": "topology", "layouts": ("2x2", "2x4")},
    "bad_replica_cross_node_bf16": {"axis": "topology", "layouts": ("2x2", "2x4")},
}

_SMALL = ("bitwise native on every case the suite ran before issue 28 (buffers of at most 8,427 elements, at most "
          "4 steps, one node)")

#: For each known-bad hook: the check that must catch it, and why nothing weaker can.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_ddp_chunked_drops_tail": (
        "parity on a bucket above 1 MiB (the 1-4 MiB bucket and the 25 MiB one): the last numel % 2**18 elements "
        "keep the local gradient * (1/N); " + _SMALL),
    "bad_ddp_large_bucket_bf16": (
        "parity on the 25 MiB bucket only (a 1-4 MiB bucket stays below 8 MiB): rounded to bfloat16; " + _SMALL),
    "bad_ddp_warmup_fp16": "long-run parity, first differs at step 10 (float16 rounding); " + _SMALL,
    "bad_ddp_skip_every_k": "long-run parity, first differs at step 36 (the step-35 gradient reused); " + _SMALL,
    "bad_ddp_noise_probe": "long-run parity, first differs at step 100 (a few ULPs); " + _SMALL,
    "bad_ddp_rank0_norm_probe": (
        "long-run parity, first differs at step 40 on rank 0 only (a few ULPs), between two check-ins: every rank "
        "must go on training after its first difference; " + _SMALL),
    "bad_ddp_reply_table_wraps": "long-run parity, first differs at step 128 (step 0's gradient replayed); " + _SMALL,
    "bad_ddp_local_world_divisor": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): gradients nodes times the mean; DDP's own "
        "arithmetic with no environment, and with one node's wherever LOCAL_WORLD_SIZE is the process group's size "
        "(where a subgroup case runs under the pool's LOCAL_WORLD_SIZE, the subgroup config catches it too)"),
    "bad_ddp_two_level_transposed": (
        "parity on 4 ranks as 2 nodes of 2 (and 8 as 2 of 4): the inter-node SUM adds a node's sum to itself; on 2 "
        "nodes of 1 the transposed groups are the right ones, and one node takes the flat path"),
    "bad_fsdp_chunked_drops_tail": (
        "parity on a flat parameter above 2**20 elements a shard (2**22 at 2 ranks): the last shard % 2**20 elements "
        "are never reduced; " + _SMALL),
    "bad_fsdp_large_fp16": "parity on a flat gradient of 2**21 elements or more: float16 rounding; " + _SMALL,
    "bad_fsdp_warmup_bf16": "long-run parity, first differs at step 150 (bfloat16 rounding); " + _SMALL,
    "bad_fsdp_skip_every_k": (
        "long-run parity, first differs at step 15 (sooner on a model with several units of one size, which share "
        "a counter); " + _SMALL),
    "bad_fsdp_noise_probe": "long-run parity, first differs at step 50 (a few ULPs); " + _SMALL,
    "bad_fsdp_node_factors": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): divided by LOCAL_WORLD_SIZE, not the world "
        "size; FSDP's own factors with no environment, and with one node's wherever LOCAL_WORLD_SIZE is the process "
        "group's size (subgroup_parity under the pool's LOCAL_WORLD_SIZE catches it too)"),
    "bad_fsdp_two_level_avg_twice": (
        "parity on 4 ranks as 2 nodes of 2 (and 8 as 2 of 4): the mean divided by LOCAL_WORLD_SIZE once more; on 2 "
        "nodes of 1 the node mean is the local gradient and the result is FSDP's"),
    "bad_fsdp_two_level_divides_grad": (
        "parity on 4 ranks as 2 nodes of 2 (and 8 as 2 of 4): sharded, output never post-divided (the post-divide "
        "lands on grad), twice the mean at 4 ranks; NO_SHARD, FSDP's factors over a two-level sum, another rounding; "
        "on 2 nodes of 1 the post-divide factor is 1 and the result is FSDP's"),
    "bad_fsdp2_async_unwaited": (
        "parity on a reduce-scatter input of 2**21 elements or more: FSDP2 reads the output before the collective "
        "wrote it (a race; seen on every such step here); " + _SMALL),
    "bad_fsdp2_chunked_drops_tail": (
        "parity on a reduce-scatter input above 2**20 elements: the output's last shard % 2**18 elements are never "
        "written; " + _SMALL),
    "bad_fsdp2_warmup_bf16": "long-run parity, first differs at step 90 (bfloat16 on the wire); " + _SMALL,
    "bad_fsdp2_reply_table_wraps": "long-run parity, first differs at step 64 (step 0's shard replayed); " + _SMALL,
    "bad_fsdp2_local_world_avg": (
        "parity with a 2-node environment (2 nodes of 1, of 2, of 4): SUM / LOCAL_WORLD_SIZE is nodes times the "
        "mean; with one node's environment also the hsdp and subgroup configs (a shard group of 2 under a "
        "LOCAL_WORLD_SIZE of 4); with no environment it divides by the group's size, gloo's AVG"),
    "bad_fsdp2_cross_node_bf16": "parity with a 2-node environment: bfloat16 on the wire; native on one node",
    "bad_replica_chunked_drops_tail": (
        "replica parity on a tensor above 2**19 elements: the last numel % 2**18 elements keep this replica's "
        "shard-group average; " + _SMALL),
    "bad_replica_large_bf16": "replica parity on a tensor of 2**20 elements or more: bfloat16 rounding; " + _SMALL,
    "bad_replica_local_sgd": "long-run replica parity, first differs at step 45 (no replica average); " + _SMALL,
    "bad_replica_noise_probe": "long-run replica parity, first differs at step 75 (a few ULPs); " + _SMALL,
    "bad_replica_local_divisor": (
        "replica parity on 4 ranks as 2 nodes of 2: SUM across replicas divided by 1; on one node the divisor is the "
        "replica count"),
    "bad_replica_cross_node_bf16": (
        "replica parity on 4 ranks as 2 nodes of 2 (the replica groups {0, 2}, {1, 3} cross nodes): bfloat16; on one "
        "node full precision"),
}
