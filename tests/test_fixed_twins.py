"""The fix each named cause implies is the right one: the zoo hook with that one change passes where it failed.

``tests/zoo/fixed_twins.py`` holds, for every zoo hook whose diagnosis names a
cause with a fix, its twin with the change the ``fix:`` line asks for. ``CASES``
below picks, per bad hook, one or two cases where it fails (the failing check, at
the world size and variant that show it), so the twins run in one short suite run
(world sizes 2 and 3, and the 4-rank pool of HSDP, replica groups and subgroups), in the zoo runs'
background threads (``TWIN_RUN``), and:

* every twin passes every case it ran, and ran every case picked for it;
* each picked case failed for the original in the zoo's meta-run (the ``zoo_runs``
  fixture, ``tests/meta_zoos/``), with the fix line its twin applies: ``FIX`` gives
  the words it must carry.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import pytest

from tests import meta_zoos
from tests.meta_helpers import BackgroundJob, SuiteRun, run_suite
from tests.zoo.fixed_twins import TWINS

#: (zoo, bad hook) -> the failing cases (test name with its case id, the bad hook's name in it) its twin must pass.
CASES: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("ddp_hooks", "bad_sum_no_average"): ("test_ddp_parity[bad_sum_no_average-default-nested_wrapped-ws2]",),
    ("ddp_hooks", "bad_stale_second_step"): ("test_ddp_parity[bad_stale_second_step-default-nested_wrapped-ws2]",),
    ("ddp_hooks", "bad_nan_to_zero"): ("test_ddp_hard_inputs[bad_nan_to_zero-default-gradient_probe-ws2]",),
    ("ddp_hooks", "bad_sum_then_divide"): ("test_ddp_parity[bad_sum_then_divide-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_divides_by_world_size"): (
        "test_ddp_parity[bad_divides_by_world_size-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_bf16_undeclared"): ("test_ddp_parity[bad_bf16_undeclared-default-nested_wrapped-ws2]",),
    ("ddp_hooks", "bad_world_size_divisor"): ("test_ddp_parity[bad_world_size_divisor-subgroup-nested_wrapped-2nodes-ws4]",),
    ("ddp_hooks", "bad_fp16_cast_back_then_divide"): (
        "test_ddp_parity[bad_fp16_cast_back_then_divide-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_rank_order_mean"): ("test_ddp_parity[bad_rank_order_mean-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_ring_no_average_tail"): (
        "test_ddp_parity[bad_ring_no_average_tail-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_rs_ag_tail_unreduced"): (
        "test_ddp_parity[bad_rs_ag_tail_unreduced-default-nested_wrapped-ws3]",),
    ("ddp_hooks", "bad_default_group"): ("test_ddp_parity[bad_default_group-subgroup-nested_wrapped-2nodes-ws4]",),
    ("ddp_hooks", "bad_noop_hook"): ("test_ddp_rank_consistency[bad_noop_hook-default-net_flat-ws2]",),
    ("fsdp_hooks", "bad_sum_no_average"): ("test_parity[bad_sum_no_average-FULL_SHARD-net_wrapped-ws2]",),
    ("fsdp_hooks", "bad_wrong_shard"): ("test_parity[bad_wrong_shard-FULL_SHARD-net_wrapped-ws2]",),
    ("fsdp_hooks", "bad_stale_after_first_step"): (
        "test_parity[bad_stale_after_first_step-NO_SHARD-net_wrapped-ws2]",),
    ("fsdp_hooks", "bad_local_only"): ("test_parity[bad_local_only-NO_SHARD-net_wrapped-ws2]",),
    ("fsdp_hooks", "bad_nan_to_zero"): ("test_hard_inputs[bad_nan_to_zero-NO_SHARD-ws2]",),
    ("fsdp_hooks", "bad_power_of_two_divisor"): ("test_parity[bad_power_of_two_divisor-FULL_SHARD-net_wrapped-ws3]",),
    ("fsdp2_comms", "bad_always_sum"): ("test_fsdp2_parity[bad_always_sum-default-nested_wrapped-ws2]",),
    ("fsdp2_comms", "bad_bf16_wire"): ("test_fsdp2_parity[bad_bf16_wire-default-nested_wrapped-ws2]",),
    ("fsdp2_comms", "bad_stale_replay"): ("test_fsdp2_parity[bad_stale_replay-default-nested_wrapped-ws2]",),
    ("fsdp2_comms", "bad_wrong_shard"): ("test_fsdp2_parity[bad_wrong_shard-default-nested_wrapped-ws2]",),
    ("fsdp2_comms", "bad_self_average_fp16"): (
        "test_fsdp2_parity[bad_self_average_fp16-default-nested_wrapped-ws2]",),
    ("fsdp2_comms", "bad_nan_to_zero"): ("test_fsdp2_hard_inputs[bad_nan_to_zero-default-gradient_probe-ws2]",),
    ("fsdp2_comms", "bad_world_size_average"): (
        "test_fsdp2_parity[bad_world_size_average-hsdp-nested_wrapped-2nodes-ws4]",
        "test_fsdp2_parity[bad_world_size_average-subgroup-nested_wrapped-2nodes-ws4]"),
    ("fsdp2_comms", "bad_world_average_hook"): (
        "test_fsdp2_all_reduce_hook[bad_world_average_hook-hsdp-nested_wrapped-2nodes-ws4]",),
    ("fsdp2_comms", "bad_replica_divide_hook"): (
        "test_fsdp2_all_reduce_hook[bad_replica_divide_hook-hsdp-nested_wrapped-2nodes-ws4]",),
    ("fsdp2_comms", "bad_replica_sum"): ("test_fsdp2_replica_parity[bad_replica_sum-replica-nested_wrapped-2nodes-ws4]",),
    ("fsdp2_comms", "bad_replica_world_divisor"): (
        "test_fsdp2_replica_parity[bad_replica_world_divisor-replica-nested_wrapped-2nodes-ws4]",),
    ("fsdp2_comms", "bad_replica_default_group"): (
        "test_fsdp2_replica_parity[bad_replica_default_group-replica-nested_wrapped-2nodes-ws4]",),
    ("fsdp2_comms", "bad_replica_out_of_place"): (
        "test_fsdp2_replica_parity[bad_replica_out_of_place-replica-nested_wrapped-2nodes-ws4]",),
}

_DDP_AVERAGE = ("multiply the bucket by 1/{n} before the all-reduce (DDP scales each gradient by 1/world_size as it "
                "fills")
_FSDP_AVERAGE = "divide by state.gradient_predivide_factor (2) before the SUM"
_FSDP2_OP = "reduce-scatter with the op FSDP2 passes the comm (here op={op})"
_REPLICA_AVERAGE = "all-reduce the tensor over the replica group the hook is given with op=ReduceOp.AVG"
_FRESH = "reduce each call's own input; keep no result from one step to the next"
_KEEP_NAN = "leave NaN and Inf as the reduction gives them"
#: (zoo, bad hook) -> words the ``fix:`` line of its failures in ``CASES`` carries: the change its twin makes.
FIX: Dict[Tuple[str, str], str] = {
    ("ddp_hooks", "bad_sum_no_average"): "fix: average: " + _DDP_AVERAGE.format(n=2),
    ("ddp_hooks", "bad_stale_second_step"): "fix: " + _FRESH,
    ("ddp_hooks", "bad_nan_to_zero"): "fix: " + _KEEP_NAN,
    ("ddp_hooks", "bad_sum_then_divide"): "fix: " + _DDP_AVERAGE.format(n=3) + " the bucket), instead of dividing "
                                                                                "the SUM by 3",
    ("ddp_hooks", "bad_divides_by_world_size"): "the bucket), instead of dividing by 3 before the SUM",
    ("ddp_hooks", "bad_bf16_undeclared"): "fix: claim reduce_dtype=torch.bfloat16 in the HookSpec",
    ("ddp_hooks", "bad_world_size_divisor"): "pass group=process_group (the process group in the hook's state) to "
                                             "dist.get_world_size",
    ("ddp_hooks", "bad_fp16_cast_back_then_divide"): "fix: cast the bucket to float16, divide it by 3 there, "
                                                     "all-reduce (SUM) in float16, then cast back",
    ("ddp_hooks", "bad_rank_order_mean"): "fix: reduce with dist.all_reduce itself, not a sum of every rank's values "
                                          "in rank order computed by the hook, and " + _DDP_AVERAGE.format(n=3),
    ("ddp_hooks", "bad_ring_no_average_tail"): "too: pass the whole buffer to the collective; and elsewhere, reduce "
                                               "with dist.all_reduce itself, not a sum of every rank's values in ring "
                                               "order",
    ("ddp_hooks", "bad_rs_ag_tail_unreduced"): "too: pass the whole buffer to the collective",
    ("ddp_hooks", "bad_default_group"): "fix: pass group=process_group (the process group in the hook's state) to "
                                        "every collective the hook issues",
    ("ddp_hooks", "bad_noop_hook"): "fix: reduce over the hook's process group (group=process_group (the process "
                                    "group in the hook's state)): " + _DDP_AVERAGE.format(n=2),
    ("fsdp_hooks", "bad_sum_no_average"): "fix: average: " + _FSDP_AVERAGE,
    ("fsdp_hooks", "bad_wrong_shard"): "fix: keep this rank's own chunk, chunk 0 of 2 (index dist.get_rank(group))",
    ("fsdp_hooks", "bad_stale_after_first_step"): "fix: " + _FRESH,
    ("fsdp_hooks", "bad_local_only"): "fix: reduce over the hook's process group (group=state.process_group): "
                                      + _FSDP_AVERAGE,
    ("fsdp_hooks", "bad_nan_to_zero"): "fix: " + _KEEP_NAN,
    ("fsdp_hooks", "bad_power_of_two_divisor"): "fix: divide as for the group's 3 ranks, not 4: " + _FSDP_AVERAGE
                                                + " and by state.gradient_postdivide_factor (1.5) after it",
    ("fsdp2_comms", "bad_always_sum"): "fix: average: " + _FSDP2_OP.format(op="AVG"),
    ("fsdp2_comms", "bad_bf16_wire"): "fix: claim reduce_dtype=torch.bfloat16 in the HookSpec",
    ("fsdp2_comms", "bad_stale_replay"): "fix: " + _FRESH,
    ("fsdp2_comms", "bad_wrong_shard"): "fix: keep this rank's own chunk, chunk 0 of 2 (index dist.get_rank(group))",
    ("fsdp2_comms", "bad_self_average_fp16"): _FSDP2_OP.format(op="SUM") + " over the group it passes, and divide "
                                                                           "nothing yourself",
    ("fsdp2_comms", "bad_nan_to_zero"): "fix: " + _KEEP_NAN,
    ("fsdp2_comms", "bad_world_size_average"): "pass group=group (the group FSDP2 passes the comm) to "
                                               "dist.get_world_size",
    ("fsdp2_comms", "bad_world_average_hook"): "fix: drop the all-reduce: leave the tensor as native HSDP hands it",
    ("fsdp2_comms", "bad_replica_divide_hook"): "fix: drop the division by 2: leave the tensor as native HSDP hands "
                                                "it",
    ("fsdp2_comms", "bad_replica_sum"): "fix: average: " + _REPLICA_AVERAGE,
    ("fsdp2_comms", "bad_replica_world_divisor"): "pass group=group (the replica group the hook is given) to "
                                                  "dist.get_world_size",
    ("fsdp2_comms", "bad_replica_default_group"): "fix: pass group=group (the replica group the hook is given) to "
                                                  "every collective the hook issues",
    ("fsdp2_comms", "bad_replica_out_of_place"): "fix: all-reduce the tensor FSDP2 passes the hook in place",
}
#: The meta-run of each zoo, whose failures the originals' cases are read from.
ZOO = {"ddp_hooks": meta_zoos.DDP, "fsdp_hooks": meta_zoos.FSDP, "fsdp2_comms": meta_zoos.FSDP2}


def _twin_case(key: Tuple[str, str], case: str) -> str:
    return case.replace(f"[{key[1]}-", f"[{TWINS[key].name}-", 1)


def _twin_cases() -> List[str]:
    return [_twin_case(key, case) for key, cases in CASES.items() for case in cases]


def _run_twins(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    """The twins, each on its picked cases, in one run: world sizes 2 and 3, and the 4-rank pool the HSDP,
    replica and subgroup cases start."""
    return run_suite(["--hook", "tests.zoo.fixed_twins:ALL", "--extra-world-size", "3", "--hypothesis-examples",
                      "2", "-q", "-k", " or ".join(_twin_cases())], os.path.join(directory, "twins.xml"), timeout=300,
                     env=env)


#: The run over the twins, in the zoo runs' background threads (``tests/conftest.py``).
TWIN_RUN = BackgroundJob("fixed_twins", _run_twins)


def test_every_twin_has_its_failing_cases_and_its_fix():
    assert set(CASES) == set(TWINS) == set(FIX)
    assert all(CASES.values())


def test_every_fixed_twin_passes_the_cases_its_original_fails(zoo_runs):
    """The twins, each on the cases its original fails, in one run: every case runs, and passes."""
    run = zoo_runs(TWIN_RUN)
    want = _twin_cases()
    ran = {c.name: c for c in run.cases}
    assert set(want) <= set(ran), f"not run: {sorted(set(want) - set(ran))}\n{run.output[-3000:]}"
    failed = {name: c.message[-1500:] for name, c in ran.items() if c.outcome != "passed"}
    assert not failed, f"twins that do not pass where their original failed: {failed}"
    assert run.returncode == 0, run.output[-3000:]


@pytest.mark.parametrize("key", sorted(CASES), ids=lambda key: f"{key[0]}-{key[1]}")
def test_the_original_fails_each_case_with_the_fix_its_twin_applies(zoo_runs, key):
    """Where the twin runs, its original failed in the zoo's meta-run, and the failure's ``fix:`` line names the
    change the twin makes."""
    run = zoo_runs(ZOO[key[0]])
    cases = {c.name: c for c in run.cases}
    for case in CASES[key]:
        assert case in cases, f"{case} is not in the {key[0]} meta-run"
        original = cases[case]
        assert original.outcome == "failed", f"{case}: {original.outcome}"
        assert FIX[key] in original.message, f"{FIX[key]!r} not in:\n{original.message[-3000:]}"
