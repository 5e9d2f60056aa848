"""The reach zoo's FSDP2 replica hooks, ``hook(state, tensor)`` with ``state = spec.state(replica_group)``, reducing
``tensor`` in place, by axis (size, horizon, topology), with their ``HookSpec`` s
(``tests/zoo/reach_hooks/__init__.py`` says what each axis means and holds ``REACH``).
"""

import os
from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _spans_nodes, _Staging, _UnitCalls

#: Tensors above 2**19 elements are all-reduced in 2**18-element chunks by bad_replica_chunked_drops_tail.
REPLICA_CHUNK_ABOVE = 2 ** 19
REPLICA_CHUNK_NUMEL = 2 ** 18
#: Tensors of 2**20 elements and more go bfloat16 in bad_replica_large_bf16.
REPLICA_BF16_NUMEL = 2 ** 20
#: Tensors of 2**19 elements and more are staged by good_replica_staged_large.
REPLICA_STAGE_NUMEL = 2 ** 19


class ReplicaState:
    """The replica group, a call count per tensor size and persistent staging buffers."""

    def __init__(self, replica_group: Any) -> None:
        self.group = replica_group
        self.units = _UnitCalls()
        self.staging = _Staging()


def _replica_avg(group: Any, tensor: torch.Tensor, async_op: bool = False) -> None:
    work = dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=async_op)
    if async_op:
        work.wait()


def _replica_bf16(group: Any, tensor: torch.Tensor) -> None:
    low = tensor.to(torch.bfloat16)
    dist.all_reduce(low, op=ReduceOp.AVG, group=group)
    tensor.copy_(low)


def _replica_staged(state: ReplicaState, tensor: torch.Tensor, async_op: bool = False) -> None:
    staged = state.staging.get("tensor", tensor).copy_(tensor)
    _replica_avg(state.group, staged, async_op=async_op)
    tensor.copy_(staged)


# -- size --------------------------------------------------------------------


def bad_replica_chunked_drops_tail(state, tensor):
    """Tensors above 2**19 elements are AVG-all-reduced across replicas in 2**18-element chunks, ``numel //
    CHUNK`` of them: the last partial chunk keeps this replica's shard-group average."""
    if tensor.numel() <= REPLICA_CHUNK_ABOVE:
        _replica_avg(state.group, tensor)
        return
    c = REPLICA_CHUNK_NUMEL
    for i in range(tensor.numel() // c):
        _replica_avg(state.group, tensor[i * c:(i + 1) * c])


def bad_replica_large_bf16(state, tensor):
    """Tensors of 2**20 elements and more cross the replicas in bfloat16 (AVG, cast back); smaller ones in full
    precision. Claims full precision."""
    if tensor.numel() >= REPLICA_BF16_NUMEL:
        _replica_bf16(state.group, tensor)
    else:
        _replica_avg(state.group, tensor)


def good_replica_staged_large(state, tensor):
    """Tensors of 2**19 elements and more go through a persistent staging buffer, one AVG all-reduce, copied back:
    native HSDP's arithmetic on both sides."""
    if tensor.numel() >= REPLICA_STAGE_NUMEL:
        _replica_staged(state, tensor)
    else:
        _replica_avg(state.group, tensor)


# -- horizon -------------------------------------------------------------------


class LocalSgdState(ReplicaState):
    """Post-local-SGD: ``start_step`` steps of full synchronisation, then replicas average every ``sync_every``."""

    def __init__(self, replica_group: Any, start_step: int = 45, sync_every: int = 4) -> None:
        super().__init__(replica_group)
        self.start_step = start_step
        self.sync_every = sync_every


def bad_replica_local_sgd(state, tensor):
    """Post-local-SGD (``start_localSGD_iter`` = 45): AVG across replicas on every step until step 45, then only on
    steps that are multiples of 4, the replicas training locally in between (a periodic model averager is supposed
    to reconcile them). Claims native HSDP's exact averaging: step 45 is the first one skipped."""
    step = state.units.step_of(tensor.numel())
    if step < state.start_step or step % state.sync_every == 0:
        _replica_avg(state.group, tensor)


class ReplicaProbeState(ReplicaState):
    def __init__(self, replica_group: Any, probe_every: int = 75) -> None:
        super().__init__(replica_group)
        self.probe_every = probe_every
        self.noise: List[float] = []


def bad_replica_noise_probe(state, tensor):
    """AVG across replicas; every 75 steps (the first at step 75) a replica-noise probe measures ``|mean - local|``
    in place on the result and adds this replica's value back: ``(m - l) + l`` is not ``m`` in floating point."""
    step = state.units.step_of(tensor.numel())
    probe = step > 0 and step % state.probe_every == 0
    local = tensor.clone() if probe else None
    _replica_avg(state.group, tensor)
    if probe:
        tensor.sub_(local)
        state.noise.append(float(tensor.norm()))
        tensor.add_(local)


class ReplicaSwitchState(ReplicaState):
    def __init__(self, replica_group: Any, start_step: int = 12) -> None:
        super().__init__(replica_group)
        self.start_step = start_step


def good_replica_warmup_switch(state, tensor):
    """For 12 steps a blocking AVG all-reduce in place; from step 12 on a persistent staging buffer and an async AVG
    all-reduce, waited on. Native HSDP's arithmetic on both paths."""
    if state.units.step_of(tensor.numel()) < state.start_step:
        _replica_avg(state.group, tensor)
    else:
        _replica_staged(state, tensor, async_op=True)


# -- topology ------------------------------------------------------------------


def bad_replica_local_divisor(state, tensor):
    """SUM across replicas, then divides by the replicas on this node, ``LOCAL_WORLD_SIZE // shards`` (written where
    every replica lived on one machine). On one node that is the replica count (and gloo's AVG is SUM, then that
    divide); on 2 nodes of 2 it is 1: the gradients are the replicas' SUM."""
    shards = dist.get_world_size() // state.group.size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    dist.all_reduce(tensor, group=state.group)
    tensor.div_(max(1, local_world_size // shards))


def bad_replica_cross_node_bf16(state, tensor):
    """Compresses the slow link: where the replica group spans nodes, bfloat16 across replicas (AVG, cast back); on
    one node full precision. Claims full precision."""
    if _spans_nodes(state.group):
        _replica_bf16(state.group, tensor)
    else:
        _replica_avg(state.group, tensor)


def good_replica_topology_async(state, tensor):
    """Where the replica group spans nodes, a persistent staging buffer and an async AVG all-reduce, waited on; on
    one node a blocking AVG in place. Native HSDP's arithmetic on both paths."""
    if _spans_nodes(state.group):
        _replica_staged(state, tensor, async_op=True)
    else:
        _replica_avg(state.group, tensor)


def _replica(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp2_replica", hook=hook, state=state, description=description)


KNOWN_GOOD: List[HookSpec] = [
    _replica("good_replica_staged_large", good_replica_staged_large, ReplicaState,
             "tensors >= 2**19 elements through a persistent buffer, one AVG all-reduce"),
    _replica("good_replica_warmup_switch", good_replica_warmup_switch, ReplicaSwitchState,
             "blocking AVG for 12 steps, then staged and async AVG, waited on"),
    _replica("good_replica_topology_async", good_replica_topology_async, ReplicaState,
             "replicas across nodes: staged and async AVG; on one node blocking AVG"),
]

KNOWN_BAD: List[HookSpec] = [
    _replica("bad_replica_chunked_drops_tail", bad_replica_chunked_drops_tail, ReplicaState,
             "tensors > 2**19 elements in 2**18 chunks, the partial last chunk dropped"),
    _replica("bad_replica_large_bf16", bad_replica_large_bf16, ReplicaState,
             "tensors >= 2**20 elements cross the replicas in bfloat16"),
    _replica("bad_replica_local_sgd", bad_replica_local_sgd, LocalSgdState,
             "post-local-SGD: from step 45 the replicas average every 4th step only"),
    _replica("bad_replica_noise_probe", bad_replica_noise_probe, ReplicaProbeState,
             "every 75 steps an in-place (m - l) + l probe on the result"),
    _replica("bad_replica_local_divisor", bad_replica_local_divisor, ReplicaState,
             "SUM, then / (LOCAL_WORLD_SIZE // shards)"),
    _replica("bad_replica_cross_node_bf16", bad_replica_cross_node_bf16, ReplicaState,
             "bfloat16 across replicas when the replica group spans nodes"),
]
