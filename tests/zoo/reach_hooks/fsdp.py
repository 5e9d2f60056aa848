"""The reach zoo's FSDP1 hooks, ``hook(state, grad)`` (``NO_SHARD``) and ``hook(state, grad, output)`` (sharded), by
axis (size, horizon, topology), with their ``HookSpec`` s (``tests/zoo/reach_hooks/__init__.py`` says what each
axis means and holds ``REACH``).
"""

import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import (_div_if_needed, _fsdp_in, _fsdp_native, _reduce_scatter, _Staging,
                                          _two_level_groups, _UnitCalls, topology)

#: Shard (or NO_SHARD gradient) chunk of bad_fsdp_chunked_drops_tail, and the size above which it chunks.
FSDP_CHUNK_NUMEL = 2 ** 20
#: Flat gradients of 2**21 elements and more are reduced in float16 by bad_fsdp_large_fp16.
FSDP_FP16_NUMEL = 2 ** 21
#: Results of 2**20 elements and more go through a persistent buffer in good_fsdp_pooled_output.
FSDP_POOL_NUMEL = 2 ** 20


class FsdpState(DefaultState):
    """``DefaultState`` (the process group and FSDP's pre/post-divide factors), plus a call count per unit and
    persistent buffers, fresh per model."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.units = _UnitCalls()
        self.staging = _Staging()


# -- size --------------------------------------------------------------------


def bad_fsdp_chunked_drops_tail(state, grad, output=None):
    """FSDP's averaging, but results above 2**20 elements are reduced in 2**20-element chunks (a reduce-scatter
    of one column block of the ``(world_size, shard)`` view at a time; NO_SHARD: an all-reduce per chunk),
    ``numel // CHUNK`` of them: the last partial chunk is never reduced (sharded: ``output`` keeps whatever its
    fresh memory held; NO_SHARD: the local gradient, pre-divided)."""
    c = FSDP_CHUNK_NUMEL
    target = grad if output is None else output
    if target.numel() <= c:
        _fsdp_native(state, grad, output)
        return
    _div_if_needed(grad, state.gradient_predivide_factor)
    for i in range(target.numel() // c):
        if output is None:
            dist.all_reduce(grad[i * c:(i + 1) * c], group=state.process_group)
        else:
            block = grad.view(state.world_size, -1)[:, i * c:(i + 1) * c].reshape(-1)  # rank r's columns, r-major
            _reduce_scatter(output[i * c:(i + 1) * c], block, state.process_group)
    _div_if_needed(target, state.gradient_postdivide_factor)


def bad_fsdp_large_fp16(state, grad, output=None):
    """FSDP's averaging, but flat gradients of 2**21 elements and more are reduced in float16 (MixedPrecision(
    reduce_dtype=float16)'s arithmetic, cast back): "large units are bandwidth-bound". Claims full precision."""
    if grad.numel() >= FSDP_FP16_NUMEL:
        _fsdp_in(torch.float16, state, grad, output)
    else:
        _fsdp_native(state, grad, output)


def good_fsdp_pooled_output(state, grad, output=None):
    """Results of 2**20 elements and more are reduced into a persistent buffer (no allocator churn for the big
    units) and copied into ``output`` (NO_SHARD: ``grad``): FSDP's own arithmetic on both sides."""
    target = grad if output is None else output
    if target.numel() < FSDP_POOL_NUMEL:
        _fsdp_native(state, grad, output)
        return
    result = _fsdp_native(state, grad, output, into=state.staging.get("result", target))
    target.copy_(result)


# -- horizon -------------------------------------------------------------------


class FsdpWarmupState(FsdpState):
    def __init__(self, process_group: Any, start_step: int = 150) -> None:
        super().__init__(process_group)
        self.start_step = start_step


def bad_fsdp_warmup_bf16(state, grad, output=None):
    """Warm-up: FSDP's averaging for 150 steps per unit, then bfloat16 compression (MixedPrecision(reduce_dtype=
    bfloat16)'s arithmetic, cast back) from step 150 on, while claiming full precision."""
    if state.units.step_of(grad.numel()) < state.start_step:
        _fsdp_native(state, grad, output)
    else:
        _fsdp_in(torch.bfloat16, state, grad, output)


class FsdpSkipState(FsdpState):
    def __init__(self, process_group: Any, skip_every: int = 16) -> None:
        super().__init__(process_group)
        self.skip_every = skip_every
        self.last: Dict[int, torch.Tensor] = {}


def bad_fsdp_skip_every_k(state, grad, output=None):
    """Communication skipping: every 16th call per unit (the first at step 15) copies the unit's last result
    instead of reducing."""
    key = grad.numel()
    target = grad if output is None else output
    last = state.last.get(key)
    if (state.units.step_of(key) + 1) % state.skip_every == 0 and last is not None and last.shape == target.shape:
        target.copy_(last)
        return
    _fsdp_native(state, grad, output)
    state.last[key] = target.detach().clone()


class FsdpProbeState(FsdpState):
    def __init__(self, process_group: Any, probe_every: int = 50) -> None:
        super().__init__(process_group)
        self.probe_every = probe_every
        self.noise: List[float] = []


def bad_fsdp_noise_probe(state, grad, output=None):
    """FSDP's averaging; every 50 steps per unit (the first at step 50) a gradient-noise probe measures
    ``|mean - local|`` in place on the result and adds this rank's local gradient back: ``(m - l) + l`` is not
    ``m`` in floating point."""
    step = state.units.step_of(grad.numel())
    probe = step > 0 and step % state.probe_every == 0
    local = None
    if probe:
        local = grad.clone() if output is None else grad.view(state.world_size, -1)[
            dist.get_rank(state.process_group)].clone()
    target = _fsdp_native(state, grad, output)
    if probe:
        target.sub_(local)
        state.noise.append(float(target.norm()))
        target.add_(local)


class FsdpSwitchState(FsdpState):
    def __init__(self, process_group: Any, start_step: int = 25) -> None:
        super().__init__(process_group)
        self.start_step = start_step


def good_fsdp_warmup_switch(state, grad, output=None):
    """For 25 steps per unit, reduces into a fresh tensor and copies it out (the conservative path while memory
    settles); from step 25 on, reduces straight into ``output`` (NO_SHARD: ``grad``) with ``async_op=True`` and a
    wait. FSDP's arithmetic on both paths."""
    if state.units.step_of(grad.numel()) < state.start_step:
        target = grad if output is None else output
        target.copy_(_fsdp_native(state, grad, output, into=torch.empty_like(target)))
    else:
        _fsdp_native(state, grad, output, async_op=True)


# -- topology ------------------------------------------------------------------


class NodeFactorState(DefaultState):
    """``DefaultState`` whose pre/post-divide factors come from ``LOCAL_WORLD_SIZE`` ("the ranks I average over"),
    as DefaultState computes them from the world size."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.gradient_predivide_factor = self._get_gradient_predivide_factor(local_world_size)
        self.gradient_postdivide_factor = local_world_size / self.gradient_predivide_factor


def bad_fsdp_node_factors(state, grad, output=None):
    """FSDP's averaging with factors from ``LOCAL_WORLD_SIZE`` (``NodeFactorState``): FSDP's own factors on one
    node; on two nodes the gradients are ``nodes`` times too large."""
    _fsdp_native(state, grad, output)


class FsdpTwoLevelState(DefaultState):
    """``DefaultState`` plus hierarchical groups from torchrun's environment (``levels`` is ``None`` on one node)."""

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)
        self.levels = _two_level_groups(process_group)


def bad_fsdp_two_level_avg_twice(state, grad, output=None):
    """Hierarchical averaging across nodes: all-reduce within the node and divide by ``LOCAL_WORLD_SIZE`` (the
    node's mean), all-reduce across nodes and divide by the world size (meant: by the node count), then take this
    rank's shard. One node takes FSDP's path. The mean is divided twice: right on 2 nodes of 1 (the node mean is
    the local gradient), ``LOCAL_WORLD_SIZE`` times too small on 2 nodes of 2."""
    if state.levels is None:
        _fsdp_native(state, grad, output)
        return
    intra, inter, local_world_size = state.levels
    dist.all_reduce(grad, group=intra)
    _div_if_needed(grad, local_world_size)
    dist.all_reduce(grad, group=inter)
    grad.div_(state.world_size)
    if output is not None:
        output.copy_(grad.view(state.world_size, -1)[dist.get_rank(state.process_group)])


def bad_fsdp_two_level_divides_grad(state, grad, output=None):
    """Hierarchical reduction across nodes with FSDP's factors: pre-divide ``grad``, all-reduce it within the node,
    then across nodes, copy this rank's shard into ``output``, then post-divide ``grad``: the wrong tensor under a
    sharded strategy, where ``output`` keeps the SUM never post-divided (twice the mean at 4 ranks). Under
    ``NO_SHARD`` ``grad`` is the result, divided as FSDP divides but summed in two levels (FSDP sums in one
    all-reduce). One node takes FSDP's path; on 2 nodes of 1 the node sum is the local gradient and the post-divide
    factor 1: FSDP's result."""
    if state.levels is None:
        _fsdp_native(state, grad, output)
        return
    intra, inter, _ = state.levels
    _div_if_needed(grad, state.gradient_predivide_factor)
    dist.all_reduce(grad, group=intra)
    dist.all_reduce(grad, group=inter)
    if output is not None:
        output.copy_(grad.view(state.world_size, -1)[dist.get_rank(state.process_group)])
    _div_if_needed(grad, state.gradient_postdivide_factor)


def good_fsdp_topology_async(state, grad, output=None):
    """Across nodes, launches the collective with ``async_op=True`` and waits (where a real hook overlaps the slow
    inter-node link); on one node, blocking. FSDP's arithmetic on both paths."""
    _, nodes, _, _ = topology(dist.get_world_size())
    _fsdp_native(state, grad, output, async_op=nodes > 1)


def _fsdp(name: str, hook: Any, state: Any, description: str) -> HookSpec:
    return HookSpec(name=name, api="fsdp", hook=hook, state=state, description=description)


KNOWN_GOOD: List[HookSpec] = [
    _fsdp("good_fsdp_pooled_output", good_fsdp_pooled_output, FsdpState,
          "results >= 2**20 elements reduced into a persistent buffer, FSDP's arithmetic"),
    _fsdp("good_fsdp_warmup_switch", good_fsdp_warmup_switch, FsdpSwitchState,
          "fresh tensor and copy for 25 steps, then async straight into output: FSDP's arithmetic"),
    _fsdp("good_fsdp_topology_async", good_fsdp_topology_async, FsdpState,
          "across nodes async and waited on, on one node blocking: FSDP's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _fsdp("bad_fsdp_chunked_drops_tail", bad_fsdp_chunked_drops_tail, FsdpState,
          "results > 2**20 elements reduced in 2**20 chunks, the partial last chunk dropped"),
    _fsdp("bad_fsdp_large_fp16", bad_fsdp_large_fp16, FsdpState,
          "flat gradients >= 2**21 elements reduced in float16, claiming full precision"),
    _fsdp("bad_fsdp_warmup_bf16", bad_fsdp_warmup_bf16, FsdpWarmupState,
          "150 steps of FSDP's averaging, then bfloat16, claiming full precision"),
    _fsdp("bad_fsdp_skip_every_k", bad_fsdp_skip_every_k, FsdpSkipState,
          "every 16th call per unit copies the unit's last result"),
    _fsdp("bad_fsdp_noise_probe", bad_fsdp_noise_probe, FsdpProbeState,
          "every 50 steps an in-place (m - l) + l probe on the result"),
    _fsdp("bad_fsdp_node_factors", bad_fsdp_node_factors, NodeFactorState,
          "pre/post-divide factors from LOCAL_WORLD_SIZE"),
    _fsdp("bad_fsdp_two_level_avg_twice", bad_fsdp_two_level_avg_twice, FsdpTwoLevelState,
          "two-level all-reduce dividing by LOCAL_WORLD_SIZE and then by the world size"),
    _fsdp("bad_fsdp_two_level_divides_grad", bad_fsdp_two_level_divides_grad, FsdpTwoLevelState,
          "two-level all-reduce with FSDP's factors, the post-divide applied to grad after the shard went to output"),
]
