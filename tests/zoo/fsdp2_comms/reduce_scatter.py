"""The FSDP2 zoo's reduce-scatter comms (``fully_shard``'s ``set_custom_reduce_scatter``): the known-good ones and
those whose reduction is wrong (the op ignored, a divisor of their own, the wrong shard or group, bfloat16 on the
wire, a stale or noisy result, hard values lost), each with its ``HookSpec`` and the config that must catch it;
``NCCL_ONLY_BAD`` (caught only where ``PREMUL_SUM`` runs) and ``THREE_RANK_BAD`` (caught only at 3 ranks).
``tests/zoo/fsdp2_comms/__init__.py`` says what "good" means for FSDP2.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter
from conformance.spec import HookSpec
from tests.zoo.plain_hooks import Alloc as _Alloc
from tests.zoo.plain_hooks import AlwaysSumComm
from tests.zoo.plain_hooks import comm_reduce_scatter as _reduce_scatter

# ---------------------------------------------------------------------------
# Known-good comms
# ---------------------------------------------------------------------------


class AsyncWaitComm(_Alloc):
    """Right: launches the reduce-scatter with ``async_op=True`` and waits before returning.

    Realistic: comms that overlap their launch with bookkeeping are written this way; FSDP2
    ignores the returned work and reads the output right away, so the wait is mandatory.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Optional[Any]:
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True)
        if async_op:
            return work
        work.wait()
        return None


class CountingComm(_Alloc):
    """Right: pass-through reduce-scatter that counts calls and bytes (a metrics wrapper).

    Realistic: the most common reason to install a custom comm is instrumentation.
    Built by a factory (the spec's ``hook`` is the class), so every model gets fresh counters.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Optional[Any]:
        self.calls += 1
        self.bytes += input_tensor.numel() * input_tensor.element_size()
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


# ---------------------------------------------------------------------------
# Known-bad comms
# ---------------------------------------------------------------------------


class SelfAveragingComm(_Alloc):
    """Wrong: ignores ``op`` (and so the divide factor): SUM, then divides by the group size itself.

    Equals the native ``AVG`` in full precision with no divide factor, but wherever FSDP2
    passes ``SUM`` and divides itself (float16; ``set_force_sum_reduction_for_comms``; a
    gradient divide factor with forced SUM) the gradients are divided twice. Realistic: the
    textbook "average = sum / n", written to be portable to backends without ``AVG``.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        _reduce_scatter(output_tensor, input_tensor, op=ReduceOp.SUM, group=group)
        output_tensor.div_(group.size())
        return None


class AllToAllMeanComm(_Alloc):
    """Wrong at 3 ranks and more: a "deterministic" reduce-scatter over an all-to-all.

    Every rank sends chunk ``j`` of its buffer to rank ``j`` (``all_to_all_single``), sums the chunks it
    receives in float32, in rank order, and for ``AVG`` multiplies by ``1/world size``. At 2 ranks that is
    native's arithmetic bit for bit (one addition; ``x * 0.5`` is ``x / 2``); at 3 the reciprocal rounds
    (``1/3`` is not a float) and the sum's order may differ from the collective's. Realistic: a comm written
    for bitwise reproducibility across backends, with the reciprocal multiply a hot loop would use.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor.contiguous(), group=group)
        chunks = received.reshape(n, -1).to(torch.float32)
        total = chunks[0].clone()
        for chunk in chunks[1:]:
            total += chunk
        if op == ReduceOp.AVG:
            total *= 1.0 / n
        output_tensor.copy_(total.view_as(output_tensor))
        return None


class WorldSizeAverageComm(_Alloc):
    """Wrong under HSDP and on a subgroup: turns ``AVG`` into a SUM and divides by ``dist.get_world_size()``.

    ``dist.get_world_size()`` with no group is the default group's size: every rank of the job, not the shard
    group FSDP2 passes the comm. Right on a 1-D mesh over every rank; under 2x2 HSDP, or on a 2-rank subgroup
    of 4, every gradient is half native's. Realistic: the portable "AVG is SUM / world size" rewrite, for a
    backend without ``AVG``, by an author who thinks of one data-parallel group.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op != ReduceOp.AVG:
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        _reduce_scatter(output_tensor, input_tensor, op=ReduceOp.SUM, group=group)
        output_tensor.div_(dist.get_world_size())
        return None


class PremulAsAvgComm(_Alloc):
    """Wrong: maps ``PREMUL_SUM(1/factor)`` to ``AVG``, so ``set_gradient_divide_factor`` is ignored.

    Passes ``SUM`` and ``AVG`` through, so it is wrong only on the ``PREMUL_SUM`` path: float32
    or bfloat16 with a divide factor that is not the group size, which gloo cannot run.
    Realistic: the workaround someone writes after ``Cannot use ReduceOp.PREMUL_SUM with Gloo``.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if getattr(op, "op", None) is not None and str(op.op).endswith("PREMUL_SUM"):
            op = ReduceOp.AVG
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class WrongShardComm(_Alloc):
    """Wrong: a hand-rolled reduce-scatter (all-reduce, then slice) that keeps chunk ``rank + 1``.

    Realistic: an off-by-one in the chunk index (ranks counted from 1).
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        dist.all_reduce(input_tensor, op=op, group=group)
        n = group.size()
        output_tensor.copy_(input_tensor.view(n, -1)[(group.rank() + 1) % n])
        return None


class DefaultGroupComm(_Alloc):
    """Wrong: captures the default process group at construction and ignores ``group``.

    Right whenever the shard group is the whole world (1-D meshes); under HSDP the shard group
    is a sub-group, and reduce-scattering over all ranks fails (FSDP2's buffers are sized for
    the shard group). Realistic: ``self.group = dist.group.WORLD`` in ``__init__``.
    """

    def __init__(self) -> None:
        self.group = dist.group.WORLD

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=self.group, async_op=async_op)


class Bf16WireComm(_Alloc):
    """Wrong dtype: communicates in bfloat16 to save bandwidth while claiming full precision.

    Realistic: gradient compression slipped into a "transport" comm.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        low_in = input_tensor.to(torch.bfloat16)
        low_out = torch.empty(output_tensor.shape, dtype=torch.bfloat16, device=output_tensor.device)
        _reduce_scatter(low_out, low_in, op=op, group=group)
        output_tensor.copy_(low_out)
        return None


class StaleReplayComm(PlainReduceScatter):
    """Wrong: caches each reduced result by buffer size and replays it from the second step on.

    Realistic: memoisation left in from benchmarking. Only a multi-step check sees it.
    """

    def __init__(self) -> None:
        self.cache: Dict[Any, torch.Tensor] = {}

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        key = (input_tensor.numel(), output_tensor.numel(), input_tensor.dtype)
        if key in self.cache:
            output_tensor.copy_(self.cache[key])
            return None
        super().__call__(output_tensor, input_tensor, group, op)
        self.cache[key] = output_tensor.detach().clone()
        return None


class Rank0NoiseComm(PlainReduceScatter):
    """Wrong: after the native reduction, rank 0 moves every element one ULP towards +inf.

    Realistic: rank-0-only post-processing (stats, a "fix-up") that perturbs the last bit.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        super().__call__(output_tensor, input_tensor, group, op)
        if group.rank() == 0:
            output_tensor.copy_(torch.nextafter(output_tensor, torch.full_like(output_tensor, float("inf"))))
        return None


class NanToZeroComm(PlainReduceScatter):
    """Wrong: after the native reduction, replaces NaN and +/-Inf by zero.

    Realistic: a "sanitizing" comm that hides a diverging step. Equal to native on every finite
    input, so only hard inputs show it.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        super().__call__(output_tensor, input_tensor, group, op)
        torch.nan_to_num_(output_tensor, nan=0.0, posinf=0.0, neginf=0.0)
        return None


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_plain_instance", api="fsdp2", hook=PlainReduceScatter(),
             description="PlainReduceScatter, as an instance shared by every model"),
    HookSpec(name="good_async_wait", api="fsdp2", hook=AsyncWaitComm,
             description="async_op=True reduce-scatter, waited on before returning"),
    HookSpec(name="good_counting_bf16", api="fsdp2", hook=CountingComm, reduce_dtype=torch.bfloat16,
             description="pass-through with call/byte counters, under reduce_dtype=bfloat16"),
    HookSpec(name="good_counting_fp16", api="fsdp2", hook=CountingComm, reduce_dtype=torch.float16,
             description="pass-through with call/byte counters, under reduce_dtype=float16"),
]

KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_always_sum", api="fsdp2", hook=AlwaysSumComm,
             description="ignores op: always SUM"),
    HookSpec(name="bad_self_average", api="fsdp2", hook=SelfAveragingComm,
             description="ignores op and the divide factor: SUM, then / group size"),
    HookSpec(name="bad_self_average_fp16", api="fsdp2", hook=SelfAveragingComm, reduce_dtype=torch.float16,
             description="SUM, then / group size, under reduce_dtype=float16 (FSDP2 divides too)"),
    HookSpec(name="bad_wrong_shard", api="fsdp2", hook=WrongShardComm,
             description="all-reduce + slice, keeps the chunk of rank + 1"),
    HookSpec(name="bad_default_group", api="fsdp2", hook=DefaultGroupComm,
             description="reduce-scatters over the default group, ignoring group"),
    HookSpec(name="bad_bf16_wire", api="fsdp2", hook=Bf16WireComm,
             description="communicates in bfloat16 while claiming full precision"),
    HookSpec(name="bad_stale_replay", api="fsdp2", hook=StaleReplayComm,
             description="replays the first step's reduced shards from step 2 on"),
    HookSpec(name="bad_rank0_noise", api="fsdp2", hook=Rank0NoiseComm,
             description="native reduce-scatter, then +1 ULP on rank 0"),
    HookSpec(name="bad_nan_to_zero", api="fsdp2", hook=NanToZeroComm,
             description="native reduce-scatter, then NaN and +/-Inf replaced by zero"),
    HookSpec(name="bad_world_size_average", api="fsdp2", hook=WorldSizeAverageComm,
             description="AVG turned into SUM, then / dist.get_world_size() (the default group's size)"),
]

#: For each known-bad spec here, the config that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_always_sum": "default: FSDP2 passes AVG in float32, SUM makes every gradient ws times too large",
    "bad_self_average": (
        "force_sum and divide_factor_force_sum: FSDP2 passes SUM and post-divides, so the comm's own "
        "division is a second one; under the default AVG it may match (gloo's AVG is SUM then divide)"
    ),
    "bad_self_average_fp16": "default: float16 always reduces with SUM and FSDP2 divides before and after",
    "bad_wrong_shard": "default: every rank's gradient shard holds its neighbour's values",
    "bad_default_group": (
        "hsdp and subgroup: on a 1-D mesh over the pool the shard group is the default group; under HSDP "
        "and on a data-parallel subgroup, reduce-scattering over all 4 ranks into a 2-rank-sized buffer raises"
    ),
    "bad_bf16_wire": "default: gradients are rounded to bfloat16 on the wire",
    "bad_stale_replay": "default, from step 2: step 1 is native, later steps replay it",
    "bad_rank0_noise": "default: rank 0's shards are one ULP above native",
    "bad_nan_to_zero": "default, hard inputs only: NaN on one rank and +Inf against -Inf come back as zeros",
    "bad_world_size_average": (
        "hsdp and subgroup: the shard group has 2 of the 4 ranks, so the SUM is divided by 4; the diagnosis names "
        "the default group's size, and 'averaged twice' beside it (the same bits); on a 1-D mesh over every rank "
        "the comm is right"
    ),
    "bad_premul_as_avg": (
        "divide_factor on NCCL: FSDP2 passes PREMUL_SUM(1/factor) and the comm averages instead; "
        "gloo has no PREMUL_SUM, so those cases are skipped there with the reason"
    ),
}

#: Bad comms only a backend with ReduceOp.PREMUL_SUM (NCCL) can catch.
NCCL_ONLY_BAD: List[HookSpec] = [
    HookSpec(name="bad_premul_as_avg", api="fsdp2", hook=PremulAsAvgComm,
             description="maps PREMUL_SUM(1/factor) to AVG: ignores set_gradient_divide_factor"),
]

#: Bad comms that are native's arithmetic bit for bit at 2 ranks (and on the 2-rank shard groups of the 4-rank
#: pool), so the zoo's meta-run, at 2 and 4, cannot catch them: ``tests/test_meta_fsdp2.py`` runs them at 3.
THREE_RANK_BAD: List[HookSpec] = [
    HookSpec(name="bad_all_to_all_mean", api="fsdp2", hook=AllToAllMeanComm,
             description="all-to-all, float32 sum in rank order, then x 1/world size"),
]
#: For each of those, what must catch it at 3 ranks, and what the diagnosis names.
THREE_RANK_EXPECTED: Dict[str, str] = {
    "bad_all_to_all_mean": (
        "default at 3 ranks, parity and hard inputs: x * (1/3) rounds unlike gloo's AVG (a SUM, then / 3); the "
        "diagnosis names the comm's own arithmetic, a sum in rank order then a multiply by 1/3; at 2 ranks it "
        "passes"
    ),
}
