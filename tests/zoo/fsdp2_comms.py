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

``LOSSY`` holds the lossy-contract story (run by ``tests/test_meta_lossy.py``, not by the
exact zoo run): a bfloat16 comm that accumulates in float32 and rounds once, more accurate
than native, declared with a fitting bound (passes with its figure) and undeclared (fails
parity at 3 ranks), and a comm whose declared bound is too tight.

Only ``torch`` and ``torch.distributed`` are imported at module level: the zoo is imported by
the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter
from conformance.apis.fsdp2_replica.builtin_hooks import replica_group_state
from conformance.spec import HookSpec, LossyContract
from tests.zoo.plain_hooks import Alloc as _Alloc
from tests.zoo.plain_hooks import AlwaysSumComm, replica_divide_hook, replica_state, replica_sum
from tests.zoo.plain_hooks import comm_reduce_scatter as _reduce_scatter

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "LOSSY", "LOSSY_EXPECTED", "NCCL_ONLY_BAD",
           "THREE_RANK_BAD", "THREE_RANK_EXPECTED"]


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


class Float32AllocComm(PlainReduceScatter):
    """Wrong dtype: ``allocate`` ignores ``dtype`` and always returns float32.

    Under ``MixedPrecisionPolicy(reduce_dtype=bfloat16/float16)`` FSDP2 then copies the
    gradients into float32 buffers, so they are never rounded to the reduce dtype and the
    reduction runs in float32. Realistic: ``torch.empty(size, device=device)`` with the dtype
    forgotten; invisible in full precision.
    """

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, device=device)


class PaddedAllocComm(PlainReduceScatter):
    """Wrong shape: ``allocate`` rounds every buffer up to a multiple of 64 elements.

    FSDP2 views the reduce-scatter input as ``(world_size, -1)`` and hands the output buffer
    to the collective as it is, so the padded buffers do not fit the shards: the
    reduce-scatter raises a size check. Realistic: alignment padding copied from a
    registered-memory allocator.
    """

    ALIGN = 64

    def allocate(self, size, *, dtype, device):
        numel = 1
        for s in size:
            numel *= int(s)
        return torch.empty(-(-numel // self.ALIGN) * self.ALIGN, dtype=dtype, device=device)


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


class StagingBufferComm(PlainReduceScatter):
    """Wrong: ``allocate`` hands out views of one persistent staging buffer.

    Every allocation starts at offset 0, so the reduce-scatter input and output alias, and
    FSDP2's sharded gradients (views into the output buffer) are overwritten by the next FSDP
    module's reduction. Realistic: a "registered buffer" optimisation that assumes each buffer
    is dead once the collective returns.
    """

    def __init__(self) -> None:
        self.buffers: Dict[Any, torch.Tensor] = {}

    def allocate(self, size, *, dtype, device):
        numel = 1
        for s in size:
            numel *= int(s)
        key = (dtype, str(device))
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel].view(*size)


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


class Fp32AccumulateComm(_Alloc):
    """Lossy by design, and more accurate than native: reduce-scatters the bfloat16 buffer in float32.

    Widens FSDP2's reduce-dtype input to float32, reduce-scatters with the ``op`` it is given (``AVG``:
    on gloo a float32 SUM, then a divide), and rounds the result to the reduce dtype once, in
    ``output_tensor.copy_``. Native bfloat16 rounds after every partial sum and after the divide. At 2
    ranks both round the exact sum once, bit for bit alike; at 3 they differ in the last bit. Realistic:
    the "accumulate wide, communicate narrow" comm, whose author knows it differs from native on purpose.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        wide_out = torch.empty(output_tensor.shape, dtype=torch.float32, device=output_tensor.device)
        _reduce_scatter(wide_out, input_tensor.to(torch.float32), op=op, group=group)
        output_tensor.copy_(wide_out)
        return None


class Int8Comm(_Alloc):
    """Lossy: 8-bit quantization with one scale per reduce-scatter (the largest magnitude over the group
    / 127), integers summed exactly in int32, scaled back; ``AVG`` divided by the group size after.

    Passes ``SUM`` through as a sum (FSDP2 divides itself); ``PREMUL_SUM`` is not handled.
    Realistic: per-tensor int8 gradient compression written as a transport.
    """

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        amax = input_tensor.detach().abs().max().reshape(1).to(torch.float32)
        dist.all_reduce(amax, op=ReduceOp.MAX, group=group)
        scale = float(amax) / 127 if float(amax) > 0 else 1.0
        q = torch.round(input_tensor.detach().to(torch.float32) / scale).to(torch.int32)
        q_out = torch.empty(output_tensor.shape, dtype=torch.int32, device=output_tensor.device)
        _reduce_scatter(q_out, q, op=ReduceOp.SUM, group=group)
        out = q_out.to(torch.float32) * scale
        if op == ReduceOp.AVG:
            out /= group.size()
        output_tensor.copy_(out)
        return None


# ---------------------------------------------------------------------------
# All-reduce hooks (native HSDP: called with the replicate-all-reduced gradient)
# ---------------------------------------------------------------------------

#: What ``observer_hook`` saw: (numel, dtype) per call; a realistic side channel.
OBSERVED: List[Any] = []


def observer_hook(tensor: torch.Tensor) -> None:
    """Right: reads the reduced gradient (its norm, for monitoring) and changes nothing."""
    OBSERVED.append((tensor.numel(), tensor.dtype, float(tensor.float().norm())))
    del OBSERVED[:-64]


def unit_scale_hook(tensor: torch.Tensor) -> None:
    """Right: an in-place gradient scaling hook configured with scale 1.0 (exact)."""
    tensor.mul_(1.0)


def world_average_hook(tensor: torch.Tensor) -> None:
    """Wrong: all-reduces (AVG) over the default group, averaging different shards together.

    Realistic: the user believes the hook must do the data-parallel all-reduce and reaches for
    the default group instead of the replicate group.
    """
    dist.all_reduce(tensor, op=ReduceOp.AVG)


def nan_to_zero_hook(tensor: torch.Tensor) -> None:
    """Wrong: replaces NaN and +/-Inf in the reduced gradient by zero (a "sanitizing" hook)."""
    torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)


def replica_sum_then_divide(group: Any, tensor: torch.Tensor) -> None:
    """Right: SUM over the replica group, then divide by its size, in place (AVG by hand)."""
    dist.all_reduce(tensor, group=group)
    tensor.div_(group.size())


def replica_async_avg(group: Any, tensor: torch.Tensor) -> None:
    """Right: an async AVG all-reduce over the replica group, waited on before returning."""
    dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=True).wait()


def replica_world_divisor(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: SUM over the replica group, then divides by dist.get_world_size(), every rank of the mesh (4),
    not the replicas (2)."""
    dist.all_reduce(tensor, group=group)
    tensor.div_(dist.get_world_size())


def replica_divide_then_sum(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: divides by the replica count, then SUMs. Exact at 2 replicas but on subnormals, where the halved
    values lose their last bit; at 3 replicas x / 3 rounds on ordinary values too."""
    tensor.div_(group.size())
    dist.all_reduce(tensor, group=group)


def replica_default_group(group: Any, tensor: torch.Tensor) -> None:
    """Wrong: averages over the default group (no group=), mixing different shards."""
    dist.all_reduce(tensor, op=ReduceOp.AVG)


def replica_out_of_place(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Wrong: averages a copy and returns it; FSDP2 ignores the return value and reads the tensor it passed."""
    out = tensor.clone()
    dist.all_reduce(out, op=ReduceOp.AVG, group=group)
    return out


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------

KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_plain_instance", api="fsdp2", hook=PlainReduceScatter(),
             description="PlainReduceScatter, as an instance shared by every model"),
    HookSpec(name="good_async_wait", api="fsdp2", hook=AsyncWaitComm,
             description="async_op=True reduce-scatter, waited on before returning"),
    HookSpec(name="good_counting_bf16", api="fsdp2", hook=CountingComm, reduce_dtype=torch.bfloat16,
             description="pass-through with call/byte counters, under reduce_dtype=bfloat16"),
    HookSpec(name="good_counting_fp16", api="fsdp2", hook=CountingComm, reduce_dtype=torch.float16,
             description="pass-through with call/byte counters, under reduce_dtype=float16"),
    HookSpec(name="good_observer_hook", api="fsdp2_all_reduce", hook=observer_hook,
             description="all-reduce hook that only reads the gradient"),
    HookSpec(name="good_unit_scale_hook", api="fsdp2_all_reduce", hook=unit_scale_hook,
             description="all-reduce hook scaling in place by 1.0"),
    HookSpec(name="good_replica_sum_then_divide", api="fsdp2_replica", hook=replica_sum_then_divide,
             state=replica_group_state, description="replica hook: SUM, then / replica count, in place"),
    HookSpec(name="good_replica_async_avg", api="fsdp2_replica", hook=replica_async_avg,
             state=replica_group_state, description="replica hook: async AVG all-reduce, waited on"),
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
    HookSpec(name="bad_fp32_alloc_bf16", api="fsdp2", hook=Float32AllocComm, reduce_dtype=torch.bfloat16,
             description="allocate ignores dtype (float32 buffers) under reduce_dtype=bfloat16"),
    HookSpec(name="bad_padded_alloc", api="fsdp2", hook=PaddedAllocComm,
             description="allocate pads every buffer to a multiple of 64 elements (wrong shape)"),
    HookSpec(name="bad_bf16_wire", api="fsdp2", hook=Bf16WireComm,
             description="communicates in bfloat16 while claiming full precision"),
    HookSpec(name="bad_staging_buffer", api="fsdp2", hook=StagingBufferComm,
             description="allocate returns views of one persistent buffer (input/output alias)"),
    HookSpec(name="bad_stale_replay", api="fsdp2", hook=StaleReplayComm,
             description="replays the first step's reduced shards from step 2 on"),
    HookSpec(name="bad_rank0_noise", api="fsdp2", hook=Rank0NoiseComm,
             description="native reduce-scatter, then +1 ULP on rank 0"),
    HookSpec(name="bad_world_average_hook", api="fsdp2_all_reduce", hook=world_average_hook,
             description="all-reduce hook averaging over the default group"),
    HookSpec(name="bad_replica_divide_hook", api="fsdp2_all_reduce", hook=replica_divide_hook,
             description="all-reduce hook dividing by the replicate size again"),
    HookSpec(name="bad_replica_sum", api="fsdp2_replica", hook=replica_sum, state=replica_state,
             description="replica hook: SUM over the replicas, no average"),
    HookSpec(name="bad_replica_world_divisor", api="fsdp2_replica", hook=replica_world_divisor,
             state=replica_group_state, description="replica hook: SUM, then / dist.get_world_size()"),
    HookSpec(name="bad_replica_divide_then_sum", api="fsdp2_replica", hook=replica_divide_then_sum,
             state=replica_group_state, description="replica hook: / replica count, then SUM"),
    HookSpec(name="bad_replica_default_group", api="fsdp2_replica", hook=replica_default_group,
             state=replica_group_state, description="replica hook: AVG over the default group"),
    HookSpec(name="bad_replica_out_of_place", api="fsdp2_replica", hook=replica_out_of_place,
             state=replica_group_state, description="replica hook: averages a copy and returns it"),
]

#: Bad comms only a backend with ReduceOp.PREMUL_SUM (NCCL) can catch.
NCCL_ONLY_BAD: List[HookSpec] = [
    HookSpec(name="bad_premul_as_avg", api="fsdp2", hook=PremulAsAvgComm,
             description="maps PREMUL_SUM(1/factor) to AVG: ignores set_gradient_divide_factor"),
]

KNOWN_BAD += [
    HookSpec(name="bad_nan_to_zero", api="fsdp2", hook=NanToZeroComm,
             description="native reduce-scatter, then NaN and +/-Inf replaced by zero"),
    HookSpec(name="bad_nan_to_zero_hook", api="fsdp2_all_reduce", hook=nan_to_zero_hook,
             description="replaces NaN and +/-Inf in the HSDP-reduced gradient by zero"),
    HookSpec(name="bad_world_size_average", api="fsdp2", hook=WorldSizeAverageComm,
             description="AVG turned into SUM, then / dist.get_world_size() (the default group's size)"),
]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD + NCCL_ONLY_BAD

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

#: The declared bound of the float32-accumulating bfloat16 comm: the input is rounded to bfloat16 once (by
#: FSDP2, before the comm) and the result once (by the comm), each by at most half a bfloat16 ULP (2**-9
#: relative); under HSDP FSDP2's own bfloat16 replicate all-reduce rounds again. Observed per step and
#: parameter (gloo, CPU, torch 2.13, the 6 steps of test_fsdp2_lossy_error): 2.8e-3 at 2 ranks, 3.2e-3 at 3,
#: 5.0e-3 under 2x2 HSDP (rank-dependent gradients partly cancel in the mean, so the error relative to it
#: exceeds one rounding). The bound is bfloat16's epsilon, 2**-7 = 7.8e-3.
BF16_ONE_ROUNDING_BOUND = 2.0 ** -7
#: What that comm promises: the bound above, same bits from the same seed, and a training loss within 1%
#: of native full precision after 10 steps.
BF16_ONE_ROUNDING = LossyContract(rel_error_bound=BF16_ONE_ROUNDING_BOUND, deterministic=True, loss_margin=0.01,
                                  loss_steps=10)

#: The lossy-contract story (``tests/meta_zoos.py``'s ``LOSSY``, and ``tests/test_meta_lossy.py``).
LOSSY_GOOD: List[HookSpec] = [
    HookSpec(name="good_fp32_accumulate_bf16", api="fsdp2", hook=Fp32AccumulateComm, reduce_dtype=torch.bfloat16,
             lossy=BF16_ONE_ROUNDING,
             description="bfloat16 buffers reduce-scattered in float32, rounded once; declared lossy"),
]
LOSSY_BAD: List[HookSpec] = [
    HookSpec(name="bad_fp32_accumulate_bf16_undeclared", api="fsdp2", hook=Fp32AccumulateComm,
             reduce_dtype=torch.bfloat16,
             description="the same float32-accumulating comm claiming native bfloat16 bit for bit"),
    HookSpec(name="bad_lossy_bf16_wire_exceeds_bound", api="fsdp2", hook=Bf16WireComm,
             lossy=LossyContract(rel_error_bound=1e-5, deterministic=True),
             description="bfloat16 on the wire, declared lossy with a float32-like bound of 1e-5"),
    HookSpec(name="bad_int8_comm_undeclared", api="fsdp2", hook=Int8Comm,
             description="8-bit quantizing reduce-scatter claiming native full precision"),
]
LOSSY: List[HookSpec] = LOSSY_GOOD + LOSSY_BAD

#: For each lossy-story bad spec, the check that must catch it and why.
LOSSY_EXPECTED: Dict[str, str] = {
    "bad_fp32_accumulate_bf16_undeclared": (
        "fsdp2_parity at 3 ranks: native bfloat16 rounds each partial sum and the divide, the comm the float32 "
        "mean once; at 2 ranks both round the exact sum once. The diagnosis names the float32 reduction, more "
        "precise than claimed, which a contract can declare: the lossy hint is offered"),
    "bad_lossy_bf16_wire_exceeds_bound": (
        "fsdp2_lossy_error: bfloat16 rounding gives a relative error near 1e-3, against a declared 1e-5"),
    "bad_int8_comm_undeclared": (
        "fsdp2_parity, with the hint to declare a LossyContract: no exact cause reproduces 8-bit rounding"),
}

#: For each known-bad spec, the config that must catch it and why.
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
    "bad_fp32_alloc_bf16": (
        "default: the gradients are reduced in float32 instead of bfloat16 (and the allocation check "
        "names the float32 buffer); in full precision the same comm is right"
    ),
    "bad_padded_alloc": (
        "default: the reduce-scatter raises on the padded buffers; the allocation check names the "
        "wrong shape above the rank's traceback"
    ),
    "bad_bf16_wire": "default: gradients are rounded to bfloat16 on the wire",
    "bad_staging_buffer": "default: input and output alias and later modules overwrite earlier gradients",
    "bad_stale_replay": "default, from step 2: step 1 is native, later steps replay it",
    "bad_rank0_noise": "default: rank 0's shards are one ULP above native",
    "bad_world_average_hook": "hsdp all-reduce hook: averaging across shard ranks mixes different shards",
    "bad_replica_divide_hook": "hsdp all-reduce hook: gradients are half the native value",
    "bad_replica_sum": "replica: twice native HSDP's average; the diagnosis names a SUM without averaging",
    "bad_replica_world_divisor": (
        "replica: divided by the default group's 4 ranks, not the 2 replicas; the diagnosis names the divisor's "
        "source"
    ),
    "bad_replica_divide_then_sum": (
        "replica, hard inputs at 2 replicas: halved subnormals lose their last bit where native divides the "
        "sum; at 3 replicas (a 6-rank pool) parity too"
    ),
    "bad_replica_default_group": "replica: averaging over the default group mixes different shards",
    "bad_replica_out_of_place": (
        "replica: the shards stay the shard group's average; FSDP2 reads the tensor it passed, not the return value"
    ),
    "bad_nan_to_zero": "default, hard inputs only: NaN on one rank and +Inf against -Inf come back as zeros",
    "bad_nan_to_zero_hook": "hsdp all-reduce hook, hard inputs only: NaN and Inf come back as zeros",
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
