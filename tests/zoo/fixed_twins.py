"""The fixed twin of every zoo hook whose diagnosis names a cause with a fix: the same hook with that one change.

Each known-bad hook of ``tests/zoo/ddp_hooks/``, ``fsdp_hooks/`` and
``fsdp2_comms/`` whose failures carry a named cause (``tests/meta_zoos/``'s
``causes``) gets a twin here, written from the bad hook's own helpers with exactly
the change its ``fix:`` line asks for, and commented with that line's words.
``tests/test_fixed_twins.py`` runs the suite over the twins on the cases where
the originals fail: every twin must pass them, which is what makes a fix line
right rather than plausible.

``TWINS`` maps ``(zoo, bad hook name)`` to the twin's spec; a twin is named
``fixed_<zoo>_<name without "bad_">``. Where a fix leaves the hook's own code
nothing to keep (a hand-written ring replaced by the collective, a hook that never
communicated), the twin is native's arithmetic written in that hook's style. Two
causes at once carry both fixes, and their twin has both changes.

Only ``torch`` and ``torch.distributed`` are imported at module level besides the
zoo modules: the twins are imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter
from conformance.apis.fsdp2_replica.builtin_hooks import replica_group_state
from conformance.spec import HookSpec
from tests.zoo import ddp_hooks as ddp
from tests.zoo import fsdp2_comms as fsdp2
from tests.zoo import fsdp_hooks as fsdp

__all__ = ["ALL", "TWINS"]


# ---------------------------------------------------------------------------
# DDP (ddp_hooks/)
# ---------------------------------------------------------------------------


def ddp_sum_no_average(process_group, bucket):
    """bad_sum_no_average, fixed: "average: multiply the bucket by 1/N before the all-reduce"."""
    buffer = bucket.buffer().mul_(1.0 / process_group.size())  # the fix
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_stale_second_step(state, bucket):
    """bad_stale_second_step, fixed: "reduce each call's own input; keep no result from one step to the next"."""
    buffer = bucket.buffer()
    # the fix: the cached-result branch is gone

    def remember(f: Any) -> torch.Tensor:
        value = f.value()
        state.first[bucket.index()] = value.clone()
        return value

    return ddp._mean_allreduce(state.process_group, buffer).then(remember)


def ddp_nan_to_zero(process_group, bucket):
    """bad_nan_to_zero, fixed: "leave NaN and Inf as the reduction gives them" (no nan_to_num_)."""
    return ddp._mean_allreduce(process_group, bucket.buffer())


def ddp_sum_then_divide(process_group, bucket):
    """bad_sum_then_divide, fixed: "multiply the bucket by 1/N before the all-reduce ..., instead of dividing the
    SUM by N"."""
    buffer = bucket.buffer().mul_(1.0 / process_group.size())  # the fix: before, not .div_ after
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_divides_by_world_size(process_group, bucket):
    """bad_divides_by_world_size, fixed: "multiply the bucket by 1/N ..., instead of dividing by N before the SUM"."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())  # the fix: mul_ by the reciprocal, not div_
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_world_size_divisor(process_group, bucket):
    """bad_world_size_divisor, fixed: "pass group=process_group ... to dist.get_world_size"."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(process_group))  # the fix
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_fp16_cast_back_then_divide(process_group, bucket):
    """bad_fp16_cast_back_then_divide, fixed: "cast the bucket to float16, divide it by N there, all-reduce (SUM) in
    float16, then cast back ..., instead of casting the float16 SUM back to float32 and dividing there"."""
    buffer = bucket.buffer()
    half = buffer.to(torch.float16).div_(process_group.size())  # the fix: the division moved here

    def back(f: Any) -> torch.Tensor:
        return buffer.copy_(f.value()[0])

    return dist.all_reduce(half, group=process_group, async_op=True).get_future().then(back)


def ddp_rank_order_mean(process_group, bucket):
    """bad_rank_order_mean, fixed: "reduce with dist.all_reduce itself, not a sum of every rank's values in rank
    order computed by the hook, and multiply the bucket by 1/N before the all-reduce"."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())  # the fix: DDP's scaling, then the collective's own sum
    dist.all_reduce(buffer, group=process_group)
    return ddp._done(buffer)


def ddp_ring_no_average_tail(process_group, bucket):
    """bad_ring_no_average_tail, fixed (both of its causes): "reduce element ... too: pass the whole buffer to the
    collective; and elsewhere, reduce with dist.all_reduce itself, not a sum ... in ring order ..., and multiply the
    bucket by 1/N before the all-reduce"."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())  # the fixes: the whole buffer, scaled, through the collective
    dist.all_reduce(buffer, group=process_group)
    return ddp._done(buffer)


def ddp_rs_ag_tail_unreduced(process_group, bucket):
    """bad_rs_ag_tail_unreduced, fixed: "reduce element ... too: pass the whole buffer to the collective" (padded
    to a multiple of the world size, as a reduce-scatter needs)."""
    buffer = bucket.buffer()
    ws = process_group.size()
    buffer.mul_(1.0 / ws)
    pad = (-buffer.numel()) % ws  # the fix: the tail goes through the collectives too, padded
    whole = torch.cat([buffer, buffer.new_zeros(pad)])
    shard = torch.empty(whole.numel() // ws, dtype=buffer.dtype)
    dist.reduce_scatter_tensor(shard, whole.clone(), group=process_group)
    dist.all_gather_into_tensor(whole, shard, group=process_group)
    buffer.copy_(whole[:buffer.numel()])
    return ddp._done(buffer)


def ddp_default_group(process_group, bucket):
    """bad_default_group, fixed: "pass group=process_group ... to every collective the hook issues"."""
    tensor = bucket.buffer().mul_(1.0 / process_group.size())
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_noop(process_group, bucket):
    """bad_noop_hook (PyTorch's noop_hook), fixed: "reduce over the hook's process group (group=process_group ...):
    multiply the bucket by 1/N before the all-reduce". noop_hook takes no state; the twin takes the process group."""
    return ddp._mean_allreduce(process_group, bucket.buffer())


# ---------------------------------------------------------------------------
# FSDP1 (fsdp_hooks/)
# ---------------------------------------------------------------------------


def fsdp_sum_no_average(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """bad_sum_no_average, fixed: "average: divide by state.gradient_predivide_factor before the SUM and by
    state.gradient_postdivide_factor after it, as FSDP's _reduce_grad does"."""
    fsdp._div_if_needed(grad, state.gradient_predivide_factor)  # the fix (and the post-divide below)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        fsdp._div_if_needed(grad, state.gradient_postdivide_factor)
    else:
        fsdp._reduce_scatter(output, grad, state.process_group)
        fsdp._div_if_needed(output, state.gradient_postdivide_factor)


def fsdp_wrong_shard(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """bad_wrong_shard, fixed: "keep this rank's own chunk ... (index dist.get_rank(group)) ..., not rank k's"."""
    ws = dist.get_world_size(state.process_group)
    rank = dist.get_rank(state.process_group)
    fsdp._div_if_needed(grad, state.gradient_predivide_factor)
    dist.all_reduce(grad, group=state.process_group)
    fsdp._div_if_needed(grad, state.gradient_postdivide_factor)
    output.copy_(grad.chunk(ws)[rank])  # the fix: rank, not (rank + 1) % ws


class FsdpFreshReduce(fsdp.StaleCachedReduce):
    """bad_stale_after_first_step, fixed: "reduce each call's own input; keep no result from one step to the next"
    (the replay of the cached result is gone)."""

    def __call__(self, state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        fsdp.NativeAveragingHook()(state, grad, output)


def fsdp_local_only(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """bad_local_only, fixed: "reduce over the hook's process group (group=state.process_group): divide by
    state.gradient_predivide_factor before the SUM and by state.gradient_postdivide_factor after it"."""
    fsdp.NativeAveragingHook()(state, grad, output)


def fsdp_nan_to_zero(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """bad_nan_to_zero, fixed: "leave NaN and Inf as the reduction gives them" (no nan_to_num_)."""
    fsdp.NativeAveragingHook()(state, grad, output)


def fsdp_power_of_two_divisor(state: DefaultState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """bad_power_of_two_divisor, fixed: "divide as for the group's N ranks, not the next power of two: ... by
    state.gradient_postdivide_factor after it"."""
    predivide = state.gradient_predivide_factor
    postdivide = state.gradient_postdivide_factor  # the fix: not next_pow2(ws) / predivide
    fsdp._div_if_needed(grad, predivide)
    if output is None:
        dist.all_reduce(grad, group=state.process_group)
        fsdp._div_if_needed(grad, postdivide)
    else:
        fsdp._reduce_scatter(output, grad, state.process_group)
        fsdp._div_if_needed(output, postdivide)


# ---------------------------------------------------------------------------
# FSDP2 comms, all-reduce hooks and replica hooks (fsdp2_comms/)
# ---------------------------------------------------------------------------


class Fsdp2OpComm(fsdp2._Alloc):
    """bad_always_sum (AlwaysSumComm), fixed: "average: reduce-scatter with the op FSDP2 passes the comm"."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return fsdp2._reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)  # the fix


class Fsdp2NoSelfDivideComm(fsdp2._Alloc):
    """bad_self_average_fp16 (SelfAveragingComm), fixed: "reduce-scatter with the op FSDP2 passes the comm (here
    op=SUM) ..., and divide nothing yourself"."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        fsdp2._reduce_scatter(output_tensor, input_tensor, op=op, group=group)  # the fix: op, and no div_
        return None


class Fsdp2OwnShardComm(fsdp2._Alloc):
    """bad_wrong_shard (WrongShardComm), fixed: "keep this rank's own chunk ... (index dist.get_rank(group))"."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        dist.all_reduce(input_tensor, op=op, group=group)
        n = group.size()
        output_tensor.copy_(input_tensor.view(n, -1)[group.rank()])  # the fix: rank, not rank + 1
        return None


class Fsdp2FreshComm(fsdp2.StaleReplayComm):
    """bad_stale_replay (StaleReplayComm), fixed: "reduce each call's own input; keep no result from one step to
    the next"."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return PlainReduceScatter.__call__(self, output_tensor, input_tensor, group, op)  # the fix: no replay


class Fsdp2GroupSizeAverageComm(fsdp2._Alloc):
    """bad_world_size_average (WorldSizeAverageComm), fixed: "pass group=group (the group FSDP2 passes the comm) to
    dist.get_world_size"."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op != ReduceOp.AVG:
            return fsdp2._reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        fsdp2._reduce_scatter(output_tensor, input_tensor, op=ReduceOp.SUM, group=group)
        output_tensor.div_(dist.get_world_size(group))  # the fix: the shard group's size
        return None


class Fsdp2KeepNanComm(PlainReduceScatter):
    """bad_nan_to_zero (NanToZeroComm), fixed: "leave NaN and Inf as the reduction gives them"."""


def fsdp2_leave_as_is_hook(tensor: torch.Tensor) -> None:
    """bad_world_average_hook and bad_replica_divide_hook, fixed: "drop the all-reduce" / "drop the division":
    "leave the tensor as native HSDP hands it to the hook: already reduced and averaged"."""
    return None


def replica_average(group: Any, tensor: torch.Tensor) -> None:
    """bad_replica_sum, fixed: "average: all-reduce the tensor over the replica group ... with op=ReduceOp.AVG"."""
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group)  # the fix: op=AVG


def replica_group_divisor(group: Any, tensor: torch.Tensor) -> None:
    """bad_replica_world_divisor, fixed: "pass group=group (the replica group the hook is given) to
    dist.get_world_size"."""
    dist.all_reduce(tensor, group=group)
    tensor.div_(dist.get_world_size(group))  # the fix


def replica_own_group(group: Any, tensor: torch.Tensor) -> None:
    """bad_replica_default_group, fixed: "pass group=group ... to every collective the hook issues"."""
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group)  # the fix


def replica_in_place(group: Any, tensor: torch.Tensor) -> None:
    """bad_replica_out_of_place, fixed: "all-reduce the tensor FSDP2 passes the hook in place"."""
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group)  # the fix: the tensor itself, not a clone


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------


def _ddp(name: str, hook: Any, state: Any = ddp.process_group_state, **kw: Any) -> HookSpec:
    return HookSpec(name=f"fixed_ddp_{name}", api="ddp", hook=hook, state=state, **kw)


def _fsdp(name: str, hook: Any, state: Any = DefaultState, **kw: Any) -> HookSpec:
    return HookSpec(name=f"fixed_fsdp_{name}", api="fsdp", hook=hook, state=state, **kw)


def _fsdp2(name: str, hook: Any, api: str = "fsdp2", **kw: Any) -> HookSpec:
    return HookSpec(name=f"fixed_fsdp2_{name}", api=api, hook=hook, **kw)


#: ``(zoo, bad hook name)`` -> its fixed twin.
TWINS: Dict[Tuple[str, str], HookSpec] = {
    ("ddp_hooks", "bad_sum_no_average"): _ddp("sum_no_average", ddp_sum_no_average),
    ("ddp_hooks", "bad_stale_second_step"): _ddp("stale_second_step", ddp_stale_second_step, ddp.StaleState),
    ("ddp_hooks", "bad_nan_to_zero"): _ddp("nan_to_zero", ddp_nan_to_zero),
    ("ddp_hooks", "bad_sum_then_divide"): _ddp("sum_then_divide", ddp_sum_then_divide),
    ("ddp_hooks", "bad_divides_by_world_size"): _ddp("divides_by_world_size", ddp_divides_by_world_size),
    # "claim reduce_dtype=torch.bfloat16 in the HookSpec if reducing in bfloat16 is meant": the hook unchanged.
    ("ddp_hooks", "bad_bf16_undeclared"): _ddp("bf16_undeclared", ddp.bad_bf16_undeclared,
                                               reduce_dtype=torch.bfloat16),
    ("ddp_hooks", "bad_world_size_divisor"): _ddp("world_size_divisor", ddp_world_size_divisor),
    ("ddp_hooks", "bad_fp16_cast_back_then_divide"): _ddp("fp16_cast_back_then_divide",
                                                          ddp_fp16_cast_back_then_divide, reduce_dtype=torch.float16),
    ("ddp_hooks", "bad_rank_order_mean"): _ddp("rank_order_mean", ddp_rank_order_mean),
    ("ddp_hooks", "bad_ring_no_average_tail"): _ddp("ring_no_average_tail", ddp_ring_no_average_tail),
    ("ddp_hooks", "bad_rs_ag_tail_unreduced"): _ddp("rs_ag_tail_unreduced", ddp_rs_ag_tail_unreduced),
    ("ddp_hooks", "bad_default_group"): _ddp("default_group", ddp_default_group),
    ("ddp_hooks", "bad_noop_hook"): _ddp("noop_hook", ddp_noop),
    ("fsdp_hooks", "bad_sum_no_average"): _fsdp("sum_no_average", fsdp_sum_no_average),
    ("fsdp_hooks", "bad_wrong_shard"): _fsdp("wrong_shard", fsdp_wrong_shard, strategies=fsdp._SHARDED),
    ("fsdp_hooks", "bad_stale_after_first_step"): _fsdp("stale_after_first_step", FsdpFreshReduce(),
                                                        fsdp.ReplayState),
    ("fsdp_hooks", "bad_local_only"): _fsdp("local_only", fsdp_local_only),
    ("fsdp_hooks", "bad_nan_to_zero"): _fsdp("nan_to_zero", fsdp_nan_to_zero),
    ("fsdp_hooks", "bad_power_of_two_divisor"): _fsdp("power_of_two_divisor", fsdp_power_of_two_divisor),
    ("fsdp2_comms", "bad_always_sum"): _fsdp2("always_sum", Fsdp2OpComm),
    # "claim reduce_dtype=torch.bfloat16 ... if reducing in bfloat16 is meant": the comm unchanged.
    ("fsdp2_comms", "bad_bf16_wire"): _fsdp2("bf16_wire", fsdp2.Bf16WireComm, reduce_dtype=torch.bfloat16),
    ("fsdp2_comms", "bad_stale_replay"): _fsdp2("stale_replay", Fsdp2FreshComm),
    ("fsdp2_comms", "bad_wrong_shard"): _fsdp2("wrong_shard", Fsdp2OwnShardComm),
    ("fsdp2_comms", "bad_self_average_fp16"): _fsdp2("self_average_fp16", Fsdp2NoSelfDivideComm,
                                                     reduce_dtype=torch.float16),
    ("fsdp2_comms", "bad_nan_to_zero"): _fsdp2("nan_to_zero", Fsdp2KeepNanComm),
    ("fsdp2_comms", "bad_world_size_average"): _fsdp2("world_size_average", Fsdp2GroupSizeAverageComm),
    ("fsdp2_comms", "bad_world_average_hook"): _fsdp2("world_average_hook", fsdp2_leave_as_is_hook,
                                                      "fsdp2_all_reduce"),
    ("fsdp2_comms", "bad_replica_divide_hook"): _fsdp2("replica_divide_hook", fsdp2_leave_as_is_hook,
                                                       "fsdp2_all_reduce"),
    ("fsdp2_comms", "bad_replica_sum"): _fsdp2("replica_sum", replica_average, "fsdp2_replica",
                                               state=replica_group_state),
    ("fsdp2_comms", "bad_replica_world_divisor"): _fsdp2("replica_world_divisor", replica_group_divisor,
                                                         "fsdp2_replica", state=replica_group_state),
    ("fsdp2_comms", "bad_replica_default_group"): _fsdp2("replica_default_group", replica_own_group,
                                                         "fsdp2_replica", state=replica_group_state),
    ("fsdp2_comms", "bad_replica_out_of_place"): _fsdp2("replica_out_of_place", replica_in_place, "fsdp2_replica",
                                                        state=replica_group_state),
}

ALL: List[HookSpec] = list(TWINS.values())
