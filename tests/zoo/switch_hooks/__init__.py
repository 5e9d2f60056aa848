"""A zoo of hooks whose other path needs two switches at once (issue 44): known-good and known-bad.

Real hooks combine their switches: PowerSGD compresses only after ``start_powerSGD_iter`` steps *and* only
tensors big enough to pay; hierarchical all-reduces switch on the node layout *and* the message size; "big
buckets go bfloat16" fast paths turn on after a warm-up. The suite's reach cases run each axis on its own (the
long runs on small models, production-sized buffers for two steps, the node layouts on small models), so none of
them takes such a path. Each hook here takes its other path only where both of its switches hold:

* **warm-up x size**: after a warm-up of 64 to 96 steps (counted as a hook can: a step counter advanced on the
  last bucket, or calls per FSDP unit, per input size) *and* on a buffer of 2**19 or 2**20 elements or more;
* **nodes x size**: where torchrun's environment says the job (or the replica group) spans nodes *and* on a
  buffer of 2**19 or 2**20 elements or more.

The bad hooks go low precision there (bfloat16, float16) or divide by ``LOCAL_WORLD_SIZE``; their good twins take
a staged or async path with the same arithmetic. The line of each hook that decides its other path ends in
``# switch``: at the default depth that branch never runs, and the hook's verdict names it; at the nightly depth
the combined cases run it, and catch the bad ones.

``SWITCHES`` says, for every hook, its two switches: ``steps`` (the warm-up, in steps), ``numel`` (the buffer size,
in elements, of the buffer the API hands the hook) and ``nodes``. XX
under ``*_declared`` names, with the switches stated (``HookSpec(switches=...)``): the suite then adds the combined
cases at every depth. Specs are named by this module's path, ``tests.zoo.switch_hooks:ALL``.
"""

from typing import Any, Dict, List

from conformance.spec import HookSpec
from tests.zoo.switch_hooks import ddp, fsdp, fsdp2, replica
from tests.zoo.switch_hooks.ddp import DDP_LARGE_NUMEL, DDP_WARMUP_STEPS
from tests.zoo.switch_hooks.fsdp import FSDP_LARGE_NUMEL, FSDP_WARMUP_STEPS
from tests.zoo.switch_hooks.fsdp2 import FSDP2_LARGE_NUMEL, FSDP2_WARMUP_STEPS
from tests.zoo.switch_hooks.replica import REPLICA_LARGE_NUMEL, REPLICA_WARMUP_STEPS

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "SWITCHES"]

KNOWN_GOOD: List[HookSpec] = ddp.KNOWN_GOOD + fsdp.KNOWN_GOOD + fsdp2.KNOWN_GOOD + replica.KNOWN_GOOD
KNOWN_BAD: List[HookSpec] = ddp.KNOWN_BAD + fsdp.KNOWN_BAD + fsdp2.KNOWN_BAD + replica.KNOWN_BAD
ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD


def _warm(steps: int, numel: int) -> Dict[str, Any]:
    return {"steps": steps, "numel": numel, "nodes": None}


def _nodes(numel: int) -> Dict[str, Any]:
    return {"steps": None, "numel": numel, "nodes": 2}


#: Each hook's two switches: ``steps`` (after how many steps), ``numel`` (from how many elements), ``nodes``.
SWITCHES: Dict[str, Dict[str, Any]] = {
    "good_ddp_warm_large_staged": _warm(DDP_WARMUP_STEPS, DDP_LARGE_NUMEL),
    "bad_ddp_warm_large_bf16": _warm(DDP_WARMUP_STEPS, DDP_LARGE_NUMEL),
    "good_ddp_nodes_large_staged": _nodes(DDP_LARGE_NUMEL),
    "bad_ddp_nodes_large_local_divisor": _nodes(DDP_LARGE_NUMEL),
    "good_fsdp_warm_large_async": _warm(FSDP_WARMUP_STEPS, FSDP_LARGE_NUMEL),
    "bad_fsdp_warm_large_fp16": _warm(FSDP_WARMUP_STEPS, FSDP_LARGE_NUMEL),
    "good_fsdp_nodes_large_async": _nodes(FSDP_LARGE_NUMEL),
    "bad_fsdp_nodes_large_fp16": _nodes(FSDP_LARGE_NUMEL),
    "good_fsdp2_warm_large_staged": _warm(FSDP2_WARMUP_STEPS, FSDP2_LARGE_NUMEL),
    "bad_fsdp2_warm_large_bf16": _warm(FSDP2_WARMUP_STEPS, FSDP2_LARGE_NUMEL),
    "good_fsdp2_nodes_large_staged": _nodes(FSDP2_LARGE_NUMEL),
    "bad_fsdp2_nodes_large_bf16": _nodes(FSDP2_LARGE_NUMEL),
    "good_replica_warm_large_staged": _warm(REPLICA_WARMUP_STEPS, REPLICA_LARGE_NUMEL),
    "bad_replica_warm_large_bf16": _warm(REPLICA_WARMUP_STEPS, REPLICA_LARGE_NUMEL),
    "good_replica_nodes_large_staged": _nodes(REPLICA_LARGE_NUMEL),
    "bad_replica_nodes_large_bf16": _nodes(REPLICA_LARGE_NUMEL),
}

_EACH_ALONE = ("bitwise native on every case of the suite's reach before issue 44, where each axis ran alone: "
               "256 steps on small models, production-sized buffers for 2 steps, 2 nodes on small models")

#: For each known-bad hook: what catches it, and why nothing weaker can.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_ddp_warm_large_bf16": "a long run past step 64 on buckets of 2**19 elements or more: bfloat16; " + _EACH_ALONE,
    "bad_ddp_nodes_large_local_divisor": (
        "parity on 2 nodes with buckets of 2**19 elements or more: nodes times the mean; " + _EACH_ALONE),
    "bad_fsdp_warm_large_fp16": (
        "a long run past 80 calls per unit on flat gradients of 2**20 elements or more: float16; " + _EACH_ALONE),
    "bad_fsdp_nodes_large_fp16": "2 nodes with flat gradients of 2**20 elements or more: float16; " + _EACH_ALONE,
    "bad_fsdp2_warm_large_bf16": (
        "a long run past 72 calls per input size on inputs of 2**19 elements or more: bfloat16; " + _EACH_ALONE),
    "bad_fsdp2_nodes_large_bf16": "2 nodes with inputs of 2**19 elements or more: bfloat16; " + _EACH_ALONE,
    "bad_replica_warm_large_bf16": (
        "a long run past 96 calls per size on replica tensors of 2**19 elements or more: bfloat16; " + _EACH_ALONE),
    "bad_replica_nodes_large_bf16": (
        "replicas across 2 nodes with tensors of 2**19 elements or more: bfloat16; " + _EACH_ALONE),
}
