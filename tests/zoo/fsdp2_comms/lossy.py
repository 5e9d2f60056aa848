"""The FSDP2 zoo's lossy story, ``LOSSY`` (run by ``tests/test_meta_lossy.py``, not by the exact zoo run): a
bfloat16 comm that accumulates in float32 and rounds once, more accurate than native, declared with a fitting
bound (passes with its figure) and undeclared (fails parity at 3 ranks), a comm whose declared bound is too
tight, and an 8-bit quantizing comm; with what must catch each bad one (``LOSSY_EXPECTED``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from conformance.spec import HookSpec, LossyContract
from tests.zoo.fsdp2_comms.reduce_scatter import Bf16WireComm
from tests.zoo.plain_hooks import Alloc as _Alloc
from tests.zoo.plain_hooks import comm_reduce_scatter as _reduce_scatter


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

#: The lossy-contract story (``tests/meta_zoos/``'s ``LOSSY``, and ``tests/test_meta_lossy.py``).
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
