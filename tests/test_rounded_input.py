"""The diagnosis's "input rounded to a narrower dtype" cause, on hand-made recorded calls of every reduction API.

A hook that rounds its float32 input to bfloat16 (or float16) before an otherwise native reduction, as the
param-dtype zoo's staging comm does (``tests/zoo/param_dtype_hooks.py``), is named by the candidate
``Reduction(rounded_to=...)`` of :meth:`conformance.ranks.arithmetic.Arithmetic.changes`, recomputed from the
call's own input. Here each API's arithmetic explains a call built by hand on a one-rank gloo group in this
process (``tests/conftest.py``'s ``gloo_group``): the rounded result is named with its fix, a right result gets
no rounding cause, an input that holds bfloat16 values already gets no such candidate, and a result rounded to
another dtype is named by that dtype only. At one rank "reduced in bfloat16" gives the same bits as the
rounding (the SUM of one value rounds nothing), so both are named; three ranks tell them apart
(``tests/test_diagnosis.py``), and the zoo's failure names it (``tests/meta_zoos/``'s ``PARAM_DTYPE``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from conformance.apis.ddp.arithmetic import DdpArithmetic
from conformance.apis.fsdp.arithmetic import FsdpArithmetic
from conformance.apis.fsdp2.arithmetic import CommArithmetic
from conformance.apis.fsdp2_all_reduce.arithmetic import AllReduceHookArithmetic
from conformance.apis.fsdp2_replica.arithmetic import ReplicaArithmetic
from conformance.ranks.arithmetic import narrower_than
from conformance.ranks.cause_words import Words
from conformance.ranks.diagnosis import explain
from conformance.ranks.hook_call import HookCall
from conformance.ranks.reduction import REDUCE_SCATTER, Reduction

#: The diagnosis recomputes a reduce-scatter with dist.reduce_scatter_tensor, which torch 2.13 deprecates by name.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_scatter_tensor` is deprecated:FutureWarning")

ROUNDED = "the float32 input rounded to bfloat16 (cast to bfloat16 and back) before an otherwise native reduction"
FIX = "reduce the input in its own dtype (float32), with no cast to bfloat16 before the collective: "


def _apis():
    """(name, arithmetic, whether its calls are a reduce-scatter's) of every API whose recorded calls carry the
    input the hook reduced, at one rank."""
    return [("fsdp2", CommArithmetic(1, torch.float32, op=dist.ReduceOp.AVG), True),
            ("fsdp", FsdpArithmetic(1, None), True),
            ("ddp", DdpArithmetic(1, None), False),
            ("fsdp2_replica", ReplicaArithmetic(1, None), False)]


def _input() -> torch.Tensor:
    # float32 values that bfloat16 and float16 both round (a random mantissa), none of them bfloat16 values.
    x = torch.randn(64, generator=torch.Generator().manual_seed(7)) * 3
    assert not torch.equal(x, x.bfloat16().float()) and not torch.equal(x, x.half().float())
    return x


def _call(x: torch.Tensor, out: torch.Tensor, sharded: bool, api: str) -> HookCall:
    group = dist.group.WORLD if api in ("fsdp2", "fsdp2_replica") else None  # those recorders keep the group
    return HookCall(step=0, index=0, where="call 0", input=x.clone(), output=out, sharded=sharded, group=group,
                    op=dist.ReduceOp.AVG if api == "fsdp2" else None)


@pytest.mark.parametrize("api, arith, sharded", [pytest.param(*a, id=a[0]) for a in _apis()])
def test_a_rounded_input_is_named_with_its_fix_and_a_right_result_is_not(gloo_group, api, arith, sharded):
    x = _input()
    right = explain(arith, _call(x, x.clone(), sharded, api), None, gloo_group, 0)
    # A right result: native first, and no rounding cause beside it (at one rank a SUM is native's average too,
    # so other causes coincide with native here; three ranks part them, tests/test_diagnosis.py).
    assert right[0].code == "native" and not any(c.code == "rounded_input" for c in right), right
    causes = explain(arith, _call(x, x.bfloat16().float(), sharded, api), None, gloo_group, 0)
    rounded = [c for c in causes if c.words.startswith(ROUNDED)]
    assert len(rounded) == 1 and rounded[0].fix.startswith(FIX), causes
    assert "native" not in [c.code for c in causes]
    # One rank: the SUM of one value rounds nothing, so native's arithmetic in bfloat16 gives the same bits; both
    # candidates are named (the claim of float32 reduction is what tells them apart at several ranks).
    assert any(c.words.startswith("reduced in bfloat16") for c in causes), causes
    # Rounded to float16 instead: named by float16, not by bfloat16.
    causes = explain(arith, _call(x, x.half().float(), sharded, api), None, gloo_group, 0)
    assert not any(c.words.startswith(ROUNDED) for c in causes), causes
    assert any(c.words.startswith("the float32 input rounded to float16") for c in causes), causes


@pytest.mark.parametrize("api, arith, sharded", [pytest.param(*a, id=a[0]) for a in _apis()])
def test_no_rounding_candidate_where_the_input_holds_bfloat16_values_already(gloo_group, api, arith, sharded):
    """One micro-batch of a bfloat16 backward: the float32 input holds bfloat16 values, so rounding it to bfloat16
    gives native's bits and is no candidate; rounding it to float16 still changes a value below float16's range
    (1e-8, a bfloat16 value that float16 flushes to zero), and is one."""
    x = _input()
    x[5] = 1e-8
    x = x.bfloat16().float()
    call = _call(x, x.clone(), sharded, api)
    names = [c.cause.words for c in arith.for_call(call).candidates(call, gloo_group, 0)]
    assert not any("rounded to bfloat16" in n for n in names), names
    assert any("rounded to float16" in n for n in names), names


def test_an_all_reduce_hook_that_rounds_the_reduced_tensor_is_named(gloo_group):
    """An FSDP2 all-reduce hook gets native HSDP's reduced tensor, to leave as it is: one that casts it to
    bfloat16 and back is named, worded for a tensor that needs no reduction; one that leaves it, not."""
    arith, x = AllReduceHookArithmetic(1, None, divisors=(2,)), _input()
    right = explain(arith, HookCall(step=0, index=0, where="call 0", input=x.clone(), output=x.clone()), None,
                    gloo_group, 0)
    assert right[0].code == "native" and not any(c.code == "rounded_input" for c in right), right
    call = HookCall(step=0, index=0, where="call 0", input=x.clone(), output=x.bfloat16().float())
    causes = explain(arith, call, None, gloo_group, 0)
    assert len(causes) == 1, causes  # neither native nor a division again: the rounding alone
    assert causes[0].words.startswith("the float32 tensor rounded to bfloat16 (cast to bfloat16 and back), where "
                                      "native HSDP"), causes
    assert causes[0].fix.startswith("leave the tensor in its own dtype (float32), with no cast to bfloat16: native "
                                    "HSDP hands the hook a float32 average over ranks"), causes


def test_the_dtypes_a_hook_might_round_to_are_narrower_than_the_input_and_the_reduction():
    assert narrower_than(torch.float32, torch.float32) == [torch.bfloat16, torch.float16]
    assert narrower_than(torch.float64, torch.float64) == [torch.float32, torch.bfloat16, torch.float16]
    assert narrower_than(torch.bfloat16, torch.float32) == []  # a bfloat16 input: nothing narrower to round to
    assert narrower_than(torch.float32, torch.bfloat16) == []  # native casts to bfloat16 itself
    assert narrower_than(torch.int64, torch.int64) == []


def test_the_rounding_cause_is_worded_from_its_field_and_the_apis_reason():
    """Words: the rounded dtype and the input's, native's arithmetic, and the fix with the API's reason (FSDP2
    names PR 125191; the shared wording says why a float32 input need not hold bfloat16 values)."""
    comm = CommArithmetic(2, torch.float32, op=dist.ReduceOp.AVG)
    words = Words(2, 2, 0, True, torch.float32, torch.float32, torch.float32, comm.describe(), comm.how_to_average(),
                  comm.group_arg, lambda n: comm.dividing_as(n).describe(), given=torch.float32,
                  why_not_rounded=comm.why_not_rounded)
    native = Reduction(op=dist.ReduceOp.AVG, dtype=torch.float32, collective=REDUCE_SCATTER)
    named = words.of(native, dataclasses.replace(native, rounded_to=torch.bfloat16))
    cause, fix = named.words, named.fix
    assert named.code == "rounded_input" and named.params == (("dtype", "bfloat16"), ("input_dtype", "float32"))
    assert cause == f"{ROUNDED}, where FSDP2 asked the comm for op=AVG over 2 ranks"
    assert fix == (FIX + "FSDP2 hands the comm its gradients in float32; with param_dtype=bfloat16 they hold bfloat16 "
                   "values after one micro-batch only: under gradient accumulation FSDP2 accumulates them in the "
                   "reduce dtype and hands the comm float32 sums (PyTorch PR 125191)")
    shared = DdpArithmetic(3, None).why_not_rounded(torch.bfloat16, torch.float32)
    assert shared.startswith("a float32 input need not hold bfloat16 values, whatever the parameter dtype")
