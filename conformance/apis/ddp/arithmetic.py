"""DDP's native reduction of one bucket, for the diagnosis (a DDP extra).

With no hook, ``Reducer`` copies each gradient into the bucket multiplied by
``1/world_size`` (``at::mul_out`` with a wrapped scalar in
``Reducer::mark_variable_ready_dense``), then SUMs. Under a reduced-precision
claim ``X`` the reference is ``X_compress_wrapper(allreduce_hook)``: cast to
``X``, divide by the world size, SUM, cast back (:class:`DdpArithmetic`).

In the ``batched_grad_copy`` config DDP divides the flat bucket by the world size
instead (:class:`BatchedDdpArithmetic`, :mod:`conformance.apis.ddp.native_modes`).

Under compiled autograd (the ``compiled_autograd`` config) DDP's python reducer
divides each parameter's gradient by the world size, then SUMs
(:class:`CompiledDdpArithmetic`): the second native a hook may have to match.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional

from conformance.protocol import Cause
from conformance.ranks.arithmetic import Arithmetic, Candidate
from conformance.shared.compare import same_bits
from conformance.ranks.reduction import ALL_REDUCE, THE_COLLECTIVES, Recompute, Reduction, Scale
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from conformance.ranks.hook_call import HookCall


class DdpArithmetic(Arithmetic):
    """DDP's ``1/N`` before the SUM, or its reference's divide in the claimed dtype (see the module docstring)."""

    def reduction(self, call: HookCall) -> Reduction:
        """``x 1/N`` in the gradient's dtype, or ``/ N`` after a cast to the claimed dtype, then a SUM all-reduce."""
        cast = (self.reduce_dtype or call.input.dtype) != call.input.dtype
        return Reduction(pre=(Scale(self.world_size, reciprocal=not cast),), dtype=self.reduce_dtype,
                         collective=ALL_REDUCE)

    def describe(self) -> str:
        ws = self.world_size
        if self.reduce_dtype is None:
            return f"DDP with no hook multiplies by 1/{ws} before the SUM"
        return f"native divides by {ws} in {dtype_name(self.reduce_dtype)} before the SUM"

    #: DDP hands the hook the state it was registered with; PyTorch's own hooks take the process group as it.
    group_arg = "group=process_group (the process group in the hook's state)"

    def how_to_average(self) -> str:
        ws = self.world_size
        if self.reduce_dtype is None:
            return (f"multiply the bucket by 1/{ws} before the all-reduce (DDP scales each gradient by 1/world_size "
                    "as it fills the bucket)")
        low = dtype_name(self.reduce_dtype)
        short = {"float16": "fp16", "bfloat16": "bf16"}.get(low, low)
        return (f"cast the bucket to {low}, divide it by {ws} there, all-reduce (SUM) in {low}, then cast back, as "
                f"{short}_compress_wrapper(allreduce_hook) does")

    def where_result_goes(self, call: HookCall) -> str:
        return "complete the future with the reduced bucket (DDP copies the future's value over the gradients)"


class BatchedDdpArithmetic(DdpArithmetic):
    """DDP's native in the ``batched_grad_copy`` config (``DistributedDataParallel(..., batched_grad_copy=True)``,
    :mod:`conformance.apis.ddp.native_modes`): the gradients copied into the bucket as they are, the flat bucket
    divided by the world size, then a SUM all-reduce. Full precision only (a reduced-precision claim's reference
    is a hook, the same in either mode)."""

    #: Dividing before the SUM is native's own order here.
    divides_before_sum = True

    def reduction(self, call: HookCall) -> Reduction:
        """``/ N`` in the gradient's dtype, then a SUM all-reduce."""
        return Reduction(pre=(Scale(self.world_size),), dtype=self.reduce_dtype, collective=ALL_REDUCE)

    def describe(self) -> str:
        return (f"DDP with batched_grad_copy=True and no hook divides the bucket by {self.world_size} before the "
                f"SUM (default DDP multiplies each gradient by 1/{self.world_size})")

    def how_to_average(self) -> str:
        ws = self.world_size
        return (f"divide the bucket by {ws} before the all-reduce (bucket.buffer().div_({ws}), as allreduce_hook "
                "does): with batched_grad_copy=True DDP copies the gradients into the bucket as they are and divides "
                f"the flat bucket by world_size, where default DDP multiplies each gradient by 1/{ws}")

    def candidates(self, call: HookCall, group: Optional[ProcessGroup], rank: int) -> List[Candidate]:
        """The shared causes, with default DDP's ``x 1/world_size`` before the SUM second: a hook written for DDP
        as constructed by default."""
        ws = self.world_size
        return _reciprocal_second(
            self, super().candidates(call, group, rank), call, group, rank, "batched_grad_copy",
            f"multiplied by 1/{ws} before the SUM, as default DDP does, where with batched_grad_copy=True DDP's "
            f"native divides the bucket: / {ws}, then SUM",
            f"divide the bucket by {ws} (bucket.buffer().div_({ws})), not multiply by 1/{ws}: DDP with "
            "batched_grad_copy=True divides the flat bucket by world_size, then SUMs")


class CompiledDdpArithmetic(Arithmetic):
    """DDP's native reduction under compiled autograd (``torch._dynamo.config.optimize_ddp = "python_reducer"``).

    There DDP bypasses its C++ ``Reducer``: a post-accumulate-grad hook on every
    parameter (``DistributedDataParallel._register_accum_grad_hook``) computes
    ``param.grad / world_size``, a functional SUM all-reduce of it
    (``torch.distributed._functional_collectives.all_reduce``) and copies it
    back into ``param.grad``: a divide, where eager DDP multiplies by
    ``1/world_size``, one parameter at a time, no bucket. At 2 ranks both are
    the same bits; at 3 they differ in the last bit. Full precision only (the
    compiled cases plan no reduced-precision claim).
    """

    #: Dividing before the SUM is native's own order here.
    divides_before_sum = True

    def reduction(self, call: HookCall) -> Reduction:
        """``param.grad / N``, then a SUM all-reduce (no bucket: one parameter a call)."""
        return Reduction(pre=(Scale(self.world_size),), dtype=self.reduce_dtype, collective=ALL_REDUCE)

    def describe(self) -> str:
        return f"compiled DDP (python_reducer) divides each gradient by {self.world_size} before the SUM"

    #: The state the hook was registered with is its first argument; the suite's zoo passes the process group.
    group_arg = "group=state (the process group in the hook's state)"

    def how_to_average(self) -> str:
        ws = self.world_size
        return (f"divide the gradient by {ws} in place, then all-reduce it (SUM) in place: grad, param = bucket; "
                f"grad.div_({ws}); dist.all_reduce(grad, group=...) (DDP's python reducer computes param.grad / "
                f"world_size, then a SUM)")

    def where_result_goes(self, call: HookCall) -> str:
        return ("write the result into grad (bucket[0], which is param.grad) in place: under compiled autograd DDP "
                "ignores what the hook returns")

    def candidates(self, call: HookCall, group: Optional[ProcessGroup], rank: int) -> List[Candidate]:
        """The shared causes, with eager DDP's ``x 1/world_size`` before the SUM second: a hook written to match
        the C++ ``Reducer`` (``Reducer::mark_variable_ready_dense``) rather than the python reducer."""
        ws = self.world_size
        return _reciprocal_second(
            self, super().candidates(call, group, rank), call, group, rank, "compiled",
            f"multiplied by 1/{ws} before the SUM, as eager DDP's C++ Reducer does, where under compiled autograd "
            f"DDP's native divides: grad / {ws}, then SUM",
            f"divide (grad.div_({ws})), not multiply by 1/{ws}: compiled DDP's native is param.grad / world_size, "
            "then SUM, not eager DDP's x 1/world_size")


def _reciprocal_second(arithmetic: Arithmetic, out: List[Candidate], call: HookCall, group: Optional[ProcessGroup],
                       rank: int, native: str, words: str, fix: str) -> List[Candidate]:
    """``out`` (native first) with default DDP's ``x 1/world_size`` before the SUM, in the collective's order, as
    the second cause (code ``"rounding_order"``, ``native``: the DDP native it misses), worded ``words`` / ``fix``:
    a native that divides (the batched copy, compiled DDP) is missed by a hook written for the default one. A
    later cause that gives the same bits on this rank (a sum in rank order of the same products) is left out: the
    collective explains it."""
    ws = arithmetic.world_size
    order = dataclasses.replace(arithmetic.reduction(call), pre=(Scale(ws, reciprocal=True),))
    cause = Cause("rounding_order", (("order", THE_COLLECTIVES), ("pre", "reciprocal"), ("divisor", ws),
                                     ("native", native)), words, fix)
    reciprocal = Candidate(cause, Recompute(call, group, ws, rank)(order))
    rest = [c for c in out[1:] if not same_bits(c.value, reciprocal.value)]
    return [out[0], reciprocal] + rest
