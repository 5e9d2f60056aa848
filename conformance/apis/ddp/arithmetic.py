"""DDP's native reduction of one bucket, for the diagnosis (a DDP extra).

With no hook, ``Reducer`` copies each gradient into the bucket multiplied by
``1/world_size`` (``at::mul_out`` with a wrapped scalar in
``Reducer::mark_variable_ready_dense``), then SUMs. Under a reduced-precision
claim ``X`` the reference is ``X_compress_wrapper(allreduce_hook)``: cast to
``X``, divide by the world size, SUM, cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from conformance.ranks.arithmetic import Arithmetic, reduced
from conformance.ranks.ulps import dtype_name


class DdpArithmetic(Arithmetic):
    """DDP's ``1/N`` before the SUM, or its reference's divide in the claimed dtype (see the module docstring)."""

    def reduce(self, t: torch.Tensor, cast: bool, call: Any, group: Any, group_size: int,
               shift: int) -> torch.Tensor:
        t = t.div(self.world_size) if cast else t.mul(1.0 / self.world_size)
        return reduced(t, call, group, group_size, shift)

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

    def where_result_goes(self, call: Any) -> str:
        return "complete the future with the reduced bucket (DDP copies the future's value over the gradients)"
