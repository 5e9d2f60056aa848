"""The DDP zoo's meta-run (``tests/zoo/ddp_hooks/``): its arguments, the checks that must catch each bad hook and
the causes its failures must name.
"""

from __future__ import annotations

from tests.meta_helpers import Catch, Cause, MetaZoo, Pick
from tests.meta_zoos.common import EXPLAINED, LOSSY_HINT, NOT_REACH, _bad_hooks_only_at, _catches
from tests.zoo import ddp_hooks, native_mode_hooks

# -- DDP (register_comm_hook on DistributedDataParallel) ------------------------------------------------

#: The checks that must catch each known-bad DDP hook (ddp_hooks.EXPECTED_CATCH says why).
DDP_MUST_CATCH = {
    "bad_sum_no_average": {"averaging", "parity", "clip_grad_norm"},
    "bad_wrong_dtype": {"future_contract"},
    "bad_stale_second_step": {"parity"},
    "bad_divides_by_world_size": {"parity"},
    "bad_averages_param_grads": {"averaging", "parity"},
    "bad_sum_then_divide": {"parity"},
    "bad_returns_list": {"future_contract", "averaging", "parity", "rank_consistency"},
    "bad_returns_none": {"future_contract", "averaging", "parity", "rank_consistency"},
    "bad_wrong_shape": {"future_contract"},
    "bad_padded_future": {"future_contract", "parity"},
    "bad_nan_to_zero": {"hard_inputs"},
    "bad_fp16_rescues_tiny_buckets": {"hard_inputs"},
    "bad_default_group": {"parity"},
    "bad_saturates_inf_off_rank0": {"hard_inputs"},
    "bad_fp16_divide_after": {"hard_inputs"},
    "bad_param_not_named_bucket": {"future_contract"},
    "bad_noop_hook": {"averaging", "parity", "rank_consistency"},
    "bad_lossy_undeclared": {"parity"},
    "bad_bf16_undeclared": {"parity"},
    "bad_lossy_exceeds_bound": {"lossy_error"},
    "bad_lossy_nan": {"lossy_error"},
    "bad_lossy_rank_dependent": {"rank_consistency"},
    "bad_lossy_nondeterministic": {"lossy_determinism"},
    "bad_lossy_diverges": {"lossy_loss"},
    "bad_returns_tensor": {"future_contract"},
    "bad_rank_order_mean": {"parity"},
    "bad_ring_no_average_tail": {"averaging", "parity"},
    "bad_rs_ag_tail_unreduced": {"parity"},
    "bad_world_size_divisor": {"parity"},
    "bad_fp16_cast_back_then_divide": {"parity", "hard_inputs"},
    "bad_static_buffers_after_warm_up": {"second_model"},
}
DDP_EXACT_CHECKS = {"averaging", "parity", "rank_consistency", "future_contract", "hard_inputs", "clip_grad_norm",
                    "second_model"}
DDP_LOSSY_CHECKS = {"lossy_error", "lossy_loss", "lossy_determinism", "rank_consistency", "future_contract"}

#: The DDP zoo's failures and the texts they must carry.
DDP_CAUSES = (
    Cause("bad_sum_no_average", "parity", ("SUM without averaging",)),
    Cause("bad_stale_second_step", "parity", ("the result of step 0 (stale)",)),
    Cause("bad_nan_to_zero", "hard_inputs", ("NaN or Inf replaced",)),
    # Sum-then-divide and divide-before-SUM, 1-2 ULP off at 3 ranks, get their arithmetic named and no
    # lossy hint (the same failures at 2 ranks do not exist).
    Cause("bad_sum_then_divide", "parity", ("SUM, then divided by 3, where DDP with no hook multiplies by 1/3",),
          no_lossy_hint=True),
    Cause("bad_divides_by_world_size", "parity",
          ("divided by 3 before the SUM, where DDP with no hook multiplies by 1/3",), no_lossy_hint=True),
    # A failure an exact cause explains is told the cause instead of the hint.
    Cause("bad_bf16_undeclared", "parity", ("reduced in bfloat16, where the hook claims no reduce dtype",),
          no_lossy_hint=True),
    Cause("bad_lossy_undeclared", "parity", (LOSSY_HINT,)),
    # Issue 18's causes, each named on its zoo hook, and no hint under any of them.
    Cause("bad_returns_tensor", ("future_contract", "averaging", "parity"),
          ("not a torch.futures.Future", "raises a RuntimeError on torch.Tensor"), no_lossy_hint=True),
    Cause("bad_world_size_divisor", "parity",
          ("divided as for 4 ranks, the default group's size (dist.get_world_size() with no group), where the "
           "hook's process group has 2: ask the process group, dist.get_world_size(group)",),
          no_lossy_hint=True),
    Cause("bad_fp16_cast_back_then_divide", ("parity", "hard_inputs"),
          ("SUM in float16, cast back to float32, then divided by",), no_lossy_hint=True),
    Cause("bad_rank_order_mean", "parity", ("summed in rank order (rank 0 + rank 1 + rank 2), then divided by 3, "
                                            "where DDP with no hook multiplies by 1/3 before the SUM",),
          (("world_size", "3"),), no_lossy_hint=True),
    Cause("bad_ring_no_average_tail", "parity", ("two causes: the local, unreduced gradient at element",
                                                 "elsewhere SUM in ring order"),
          (("world_size", "3"),), no_lossy_hint=True),
    Cause("bad_ring_no_average_tail", ("averaging", "parity"), (EXPLAINED,), no_lossy_hint=True),
    Cause("bad_rs_ag_tail_unreduced", "parity", ("two causes: the local gradient multiplied by 1/",
                                                 "never reduced at element", "elsewhere native's result"),
          no_lossy_hint=True),
    Cause("bad_default_group", "parity", ("the hook ran a collective over the default group (4 ranks: no group= "
                                          "given), where its process group has 2",), no_lossy_hint=True),
    # Rank consistency failures carry the diagnosis too.
    Cause("bad_noop_hook", "rank_consistency", ("the local, unreduced gradient: the hook never communicated",)),
)


#: Restricted to the DDP module; ``transformer_shared`` only for the loss-margin check (the only case
#: that needs a real training loss); the default ``make conform`` run covers it for the built-in hooks.
#: Hard inputs, where a generated example fails, shrink it one dispatch per example (about half this
#: run's time): the stale hook's and the two tail hooks' hard-input cases (caught by parity; nothing
#: asserts on them) are left out, and the shrink of bad_saturates_inf_off_rank0 runs at world size 2 in the
#: default config only (each config's search and shrink cost about 10 s; the other configs find the same
#: example). Bad hooks' future contracts run at 2 ranks (the 3-rank buckets break them the same way; the good
#: hooks keep both), and their clip cases only for the hook clipping must catch.
DDP = MetaZoo(
    name="ddp_hooks",
    args=("--hook", "tests.zoo.ddp_hooks:ALL", "-q",
          "-k", f"{NOT_REACH} and test_ddp and (not transformer_shared or lossy_loss) and not (test_ddp_hard_inputs and "
                "(bad_stale_second_step or bad_rs_ag_tail_unreduced or bad_ring_no_average_tail or "
                "(bad_saturates_inf_off_rank0 and (ws3 or not default)))) "
                "and not (bad_fp16_rescues_tiny_buckets and not test_ddp_hard_inputs) "
                "and not (bad_ and test_ddp_future_contract and ws3) and not batched_grad_copy "
                "and " + _bad_hooks_only_at(DDP_MUST_CATCH, causes=DDP_CAUSES)),
    bad=frozenset(s.name for s in ddp_hooks.KNOWN_BAD),
    documented=frozenset(ddp_hooks.EXPECTED_CATCH),
    catches=_catches(DDP_MUST_CATCH),
    good=tuple(ddp_hooks.KNOWN_GOOD),
    good_coverage=lambda spec: ("check", DDP_EXACT_CHECKS if spec.lossy is None else DDP_LOSSY_CHECKS, True),
    acting=Pick("bad_divides_by_world_size", (("check", "parity"),), "failed"),
    acting_needles=("hook bad_divides_by_world_size does not conform", "check=parity", "api=ddp",
                    "config=default", "model=nested_wrapped", "world_size=3", "[rank 0, step 0, parameter '",
                    "first difference at index", "max ULP diff", "Re-run just this case:",
                    "-k 'test_ddp_parity[bad_divides_by_world_size-default-nested_wrapped-ws3]'"),
    rerun=Pick("bad_stale_second_step", (("check", "parity"),), "failed"),
    causes=DDP_CAUSES,
)


# -- DDP's two natives (issue 45): the default and batched_grad_copy=True ------------------------------------------

#: Each hook written for one of its API's natives (DDP's and FSDP2's), in every parity case: the good ones conform
#: (their other native's cases skipped with the reason), the bad ones claim both and are caught in the config of
#: the other (DDP's at 3 ranks).
NATIVE_MODES = MetaZoo(
    name="native_mode_hooks",
    args=("--hook", "tests.zoo.native_mode_hooks:ALL", "-q", "-k",
          "test_ddp_parity or test_fsdp2_parity or test_fsdp2_accumulation"),
    bad=frozenset(s.name for s in native_mode_hooks.KNOWN_BAD),
    documented=frozenset(native_mode_hooks.EXPECTED_CATCH),
    catches=(Catch("bad_reciprocal_in_batched_native", frozenset({"batched_grad_copy"}), "config", True),
             Catch("bad_divides_in_default_native", frozenset({"default"}), "config", True),
             Catch("bad_always_sum_in_default_native", frozenset({"default"}), "config")),
    good=tuple(native_mode_hooks.KNOWN_GOOD),
    good_outcomes=frozenset({"passed", "skipped"}),
    causes=(
        Cause("bad_reciprocal_in_batched_native", "parity",
              ("multiplied by 1/3 before the SUM, as default DDP does, where with batched_grad_copy=True DDP's native "
               "divides the bucket: / 3, then SUM", "bucket.buffer().div_(3)"), no_lossy_hint=True),
        Cause("bad_divides_in_default_native", "parity",
              ("divided by 3 before the SUM, where DDP with no hook multiplies by 1/3",), no_lossy_hint=True),
        Cause("bad_always_sum_in_default_native", "fsdp2_parity",
              ("SUM without averaging", "here op=AVG"), where=(("config", "default"),), no_lossy_hint=True),
    ),
)
