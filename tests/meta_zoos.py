"""The meta-runs, as data: each zoo, the arguments it runs with, and what its JUnit XML must show.

``tests/test_meta.py`` holds the meta-test shape once, parametrized over ``ZOOS``; the few tests truly
specific to one API read the same run (``tests/conftest.py``: one run per zoo per session) from
``tests/test_meta_fsdp.py``, ``test_meta_ddp.py``, ``test_meta_fsdp2.py`` and ``test_meta_lossy.py``.
Each zoo module's ``EXPECTED_CATCH`` (or ``LOSSY_EXPECTED``) says why each catch below must hold.
"""

from __future__ import annotations

import torch

from tests.meta_helpers import Catch, Cause, MetaZoo, Pick
from tests.zoo import ddp_hooks, fsdp2_all_gathers, fsdp2_comms, fsdp_hooks, param_dtype_hooks, reach_hooks

#: The hint an exact-claiming hook gets where no named exact cause explains its difference.
LOSSY_HINT = "lossy=LossyContract(rel_error_bound=..., loss_margin=...)"
#: Where a named exact cause explains a difference, the diagnosis says so with these words.
EXPLAINED = "explained, bit for bit, by"


#: The cases of the suite's reach (issue 28), as ``-k`` clauses: production-sized buffers, the long runs, and the
#: topology cases (parity on 2 simulated nodes; not the subgroup, HSDP and replica cases, which the zoos below
#: already run and which also run on 2 nodes). The zoos of the other classes leave them out: each costs seconds,
#: and the reach zoo (:data:`REACH`) is the one that runs them.
TOPOLOGY_CASES = ("((test_parity and 2nodes) or (test_ddp_parity and default-nested_wrapped-2nodes) "
                  "or (test_fsdp2_parity and default-nested_wrapped-2nodes) or replicate-nested_wrapped-2nodes)")
REACH_CASES = f"(large_probe or long_run or {TOPOLOGY_CASES})"
NOT_REACH = f"not {REACH_CASES}"


def _catches(table, by="check", only=False):
    return tuple(Catch(hook, frozenset(values), by, only) for hook, values in table.items())


def _bad_hooks_only_at(*tables, causes=()):
    """A ``-k`` clause: every case of a good hook, and a bad hook's cases only at the checks named for it (what
    must catch it, the checks its causes read). Nothing asserts on a bad hook's other checks, which cost half a
    zoo run; the good hooks still run every check, so a false alarm anywhere shows."""
    checks = {}
    for table in tables:
        for hook, values in table.items():
            checks.setdefault(hook, set()).update(values)
    for cause in causes:
        checks.setdefault(cause.hook, set()).update(cause.check if isinstance(cause.check, tuple) else (cause.check,))
    terms = [f"({hook} and ({' or '.join(sorted(values))}))" for hook, values in sorted(checks.items())]
    return "(not bad_ or " + " or ".join(terms) + ")"


# -- FSDP1 (register_comm_hook on FullyShardedDataParallel) ------------------------------------------

#: The checks that must catch each known-bad FSDP hook (see fsdp_hooks.EXPECTED_CATCH for why).
FSDP_MUST_CATCH = {
    "bad_sum_no_average": {"averaging", "parity", "clip_grad_norm"},
    "bad_divide_after": {"hard_inputs"},
    "bad_wrong_shard": {"parity"},
    "bad_stale_after_first_step": {"parity"},
    "bad_no_cast_back": {"parity"},
    "bad_local_only": {"averaging", "parity", "rank_consistency"},
    "bad_power_of_two_divisor": {"averaging", "parity"},
    "bad_rank0_only_noise": {"parity", "rank_consistency"},
    "bad_nan_to_zero": {"hard_inputs"},
    "bad_default_group": {"subgroup_parity"},
    "bad_sum_then_divide": {"hard_inputs"},
    "bad_fp32_accumulate": {"clip_grad_norm_low_precision"},
}
#: hook -> (check, the diagnosis its failures must carry).
FSDP_DIAGNOSED = {
    "bad_sum_no_average": ("parity", "SUM without averaging"),
    "bad_wrong_shard": ("parity", "the reduced shard of rank"),
    "bad_stale_after_first_step": ("parity", "the result of step 0 (stale)"),
    "bad_local_only": ("parity", "the hook never communicated"),
    "bad_nan_to_zero": ("hard_inputs", "NaN or Inf replaced"),
    "bad_power_of_two_divisor": ("parity", "divided as for 4 ranks"),
}


def _fsdp_coverage(spec):
    # The float16-gradient clip case is planned, and skipped with its reason, for other claims.
    low_precision = {"clip_grad_norm_low_precision"} if spec.reduce_dtype in (None, torch.float16) else set()
    return "check", {"averaging", "parity", "accumulation", "rank_consistency", "registration", "hard_inputs",
                     "subgroup_parity", "clip_grad_norm"} | low_precision, True


#: The FSDP zoo's failures and the texts they must carry.
FSDP_CAUSES = tuple(Cause(hook, check, (cause,)) for hook, (check, cause) in FSDP_DIAGNOSED.items()) + (
    # A sum without averaging is a named exact cause, not a lossy design: no LossyContract hint.
    Cause("bad_sum_no_average", ("averaging", "parity"), (EXPLAINED,), no_lossy_hint=True),
    # Rank consistency failures carry the diagnosis too.
    Cause("bad_local_only", "rank_consistency", ("the local, unreduced gradient",)),
)


#: The run skips the two largest parity models, and accumulation but for the good hooks on late_branch at 2
#: ranks (no false alarm; the bad hooks are caught elsewhere), to stay quick; ``make conform`` exercises
#: them. The clip cases of bad hooks run only for those clipping must catch (the others are caught by the
#: checks that name them). It also
#: leaves out the stale hook's hard-input cases: a generated example fails there and is shrunk one
#: dispatch per example, while the hook is caught (and asserted on) by parity; the shrink itself is
#: asserted on the DDP run (bad_saturates_inf_off_rank0).
FSDP = MetaZoo(
    name="fsdp_hooks",
    args=("--hook", "tests.zoo.fsdp_hooks:ALL", "--hypothesis-examples", "2", "-q",
          "-k", f"{NOT_REACH} and not transformer_shared and not always_wrap_nested "
                "and not (test_hard_inputs and bad_stale_after_first_step) "
                "and not (test_accumulation and (ws3 or nested_wrapped or bad_)) "
                "and " + _bad_hooks_only_at(FSDP_MUST_CATCH, causes=FSDP_CAUSES)),
    bad=frozenset(s.name for s in fsdp_hooks.KNOWN_BAD),
    documented=frozenset(fsdp_hooks.EXPECTED_CATCH),
    catches=_catches(FSDP_MUST_CATCH),
    good=tuple(fsdp_hooks.KNOWN_GOOD),
    good_coverage=_fsdp_coverage,
    acting=Pick("bad_rank0_only_noise", (("check", "parity"), ("model", "net_wrapped"), ("strategy", "NO_SHARD"),
                                         ("world_size", "2"))),
    acting_needles=("hook bad_rank0_only_noise does not conform", "check=parity", "strategy=NO_SHARD",
                    "model=net_wrapped", "world_size=2", "[rank 0, step 0, parameter '", "first difference at index",
                    "max abs diff", "max ULP diff 1", "Re-run just this case:",
                    "-k 'test_parity[bad_rank0_only_noise-NO_SHARD-net_wrapped-ws2]'"),
    rerun=Pick("bad_wrong_shard", outcome="failed"),
    causes=FSDP_CAUSES,
)


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
}
DDP_EXACT_CHECKS = {"averaging", "parity", "rank_consistency", "future_contract", "hard_inputs", "clip_grad_norm"}
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
                "and not (bad_ and test_ddp_future_contract and ws3) "
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


# -- FSDP2 (fully_shard's custom reduce-scatter and all-reduce hooks) -------------------------------------

#: The configs (``config`` property) that must catch each known-bad spec; see fsdp2_comms.EXPECTED_CATCH.
FSDP2_MUST_CATCH = {
    "bad_always_sum": {"default", "hsdp"},
    "bad_self_average": {"force_sum", "divide_factor_force_sum"},
    "bad_self_average_fp16": {"default", "divide_factor", "hsdp"},
    "bad_wrong_shard": {"default", "force_sum", "divide_factor_force_sum", "hsdp"},
    "bad_default_group": {"hsdp", "subgroup"},
    "bad_fp32_alloc_bf16": {"default", "hsdp"},
    "bad_padded_alloc": {"default", "hsdp"},
    "bad_bf16_wire": {"default", "hsdp"},
    "bad_staging_buffer": {"default", "hsdp"},
    "bad_stale_replay": {"default", "hsdp"},
    "bad_rank0_noise": {"default", "hsdp"},
    "bad_world_average_hook": {"hsdp"},
    "bad_replica_divide_hook": {"hsdp"},
    "bad_replica_sum": {"replica"},
    "bad_replica_world_divisor": {"replica"},
    "bad_replica_default_group": {"replica"},
    "bad_replica_out_of_place": {"replica"},
    "bad_world_size_average": {"hsdp", "subgroup"},
}
#: Caught only by hard inputs (NaN, Inf, subnormals): the check, not the config, is what matters.
FSDP2_MUST_CATCH_BY_CHECK = {"bad_nan_to_zero": {"fsdp2_hard_inputs"},
                             "bad_nan_to_zero_hook": {"fsdp2_all_reduce_hard_inputs"},
                             # At 2 replicas only subnormals tell dividing first from averaging the SUM.
                             "bad_replica_divide_then_sum": {"fsdp2_replica_hard_inputs"}}
#: Caught only where ReduceOp.PREMUL_SUM runs natively (NCCL); skipped with the reason on gloo.
FSDP2_MUST_CATCH_WITH_PREMUL_SUM = {"bad_premul_as_avg": {"divide_factor"}}
#: comm -> (check, the diagnosis its failures must carry), recomputed with the op and group FSDP2 passed.
FSDP2_DIAGNOSED = {
    "bad_always_sum": ("fsdp2_parity", "SUM without averaging"),
    "bad_bf16_wire": ("fsdp2_parity", "reduced in bfloat16, where the hook claims no reduce dtype"),
    "bad_stale_replay": ("fsdp2_parity", "the result of step 0 (stale)"),
    "bad_wrong_shard": ("fsdp2_parity", "the reduced shard of rank"),
    "bad_self_average_fp16": ("fsdp2_parity", "SUM, then divided by 2, where FSDP2 asked the comm for op=SUM"),
    "bad_nan_to_zero": ("fsdp2_hard_inputs", "NaN or Inf replaced"),
    "bad_world_average_hook": ("fsdp2_all_reduce_hook", "averaged again over the default group"),
    "bad_replica_divide_hook": ("fsdp2_all_reduce_hook", "divided by 2 after native HSDP had already averaged it"),
}
#: replica all-reduce hook -> (check, the diagnosis its failures must carry), over the replica group.
REPLICA_DIAGNOSED = {
    "bad_replica_sum": ("fsdp2_replica_parity", "SUM without averaging"),
    "bad_replica_world_divisor": ("fsdp2_replica_parity", "divided as for 4 ranks, the default group's size"),
    "bad_replica_default_group": ("fsdp2_replica_parity", "the hook ran a collective over the default group"),
    "bad_replica_out_of_place": ("fsdp2_replica_parity", "but its result is the local gradient it received"),
}


def _fsdp2_coverage(spec):
    if spec.api == "fsdp2_all_reduce":
        return "config", {"hsdp", "replicate", "replicate_sum"}, True
    if spec.api == "fsdp2_replica":
        return "config", {"replica", "all_reduce_off"}, True  # all_reduce_off: its accumulation case
    want = {"default", "divide_factor_force_sum", "hsdp"}
    if spec.reduce_dtype == torch.float16:
        want.add("divide_factor")  # float16 reduces with SUM: no PREMUL_SUM, runs on gloo too
    return "config", want, False


#: Limited to ``nested_wrapped``, which every config (default, divide factor, forced SUM, both, HSDP) uses,
#: and to the main world size plus HSDP and the replica hooks on a 4-rank pool (``--extra-world-size 4``;
#: no zoo entry depends on world size 3), accumulation for the good comms at the main world size only;
#: ``make conform`` covers the rest.
FSDP2 = MetaZoo(
    name="fsdp2_comms",
    args=("--hook", "tests.zoo.fsdp2_comms:ALL", "--extra-world-size", "4", "-q",
          "-k", f"{NOT_REACH} and fsdp2 and (nested_wrapped or hard_inputs) and (ws2 or hsdp or subgroup or fsdp2_replica) "
                "and not (fsdp2_accumulation and hsdp) and not (accumulation and bad_) "
                "and not (test_fsdp2_parity and replicate and not (good_async_wait or bad_padded_alloc))"),
    bad=frozenset(s.name for s in fsdp2_comms.KNOWN_BAD + fsdp2_comms.NCCL_ONLY_BAD),
    documented=frozenset(fsdp2_comms.EXPECTED_CATCH),
    catches=_catches(FSDP2_MUST_CATCH, by="config") + _catches(FSDP2_MUST_CATCH_BY_CHECK, only=True),
    caught_elsewhere=frozenset(FSDP2_MUST_CATCH_WITH_PREMUL_SUM),
    good=tuple(fsdp2_comms.KNOWN_GOOD),
    good_coverage=_fsdp2_coverage,
    good_outcomes=frozenset({"passed", "skipped"}),
    acting=Pick("bad_rank0_noise", (("config", "default"), ("world_size", "2"))),
    acting_needles=("hook bad_rank0_noise does not conform", "check=fsdp2_parity", "config=default",
                    "model=nested_wrapped", "world_size=2", "[rank 0, step 0, parameter '",
                    "differs from native fully_shard", "FSDP2 called the comm with op=", "over a group of 2",
                    "max ULP diff 1", "Re-run just this case:",
                    "-k 'test_fsdp2_parity[bad_rank0_noise-default-nested_wrapped-ws2]'"),
    rerun=Pick("bad_wrong_shard", (("world_size", "2"),), "failed"),
    causes=tuple(Cause(hook, check, (cause,), (("config", ("default", "hsdp")),))
                 for hook, (check, cause) in FSDP2_DIAGNOSED.items()) + tuple(
        Cause(hook, check, (cause,), (("config", ("replica",)),), no_lossy_hint=True)
        for hook, (check, cause) in REPLICA_DIAGNOSED.items()) + (
        # The default group's size as the divisor, named as for DDP, and beside it 'averaged twice', which gives
        # the same bits on a 2-rank shard group of 4 ranks: both causes, each with its fix.
        Cause("bad_world_size_average", "fsdp2_parity",
              ("divided as for 4 ranks, the default group's size (dist.get_world_size() with no group), where the "
               "hook's process group has 2", "averaged twice: native's average divided by 2 again",
               "fix, if divided as for 4 ranks, the default group's size (dist.get_world_size() with no group): pass "
               "group=group (the group FSDP2 passes the comm) to dist.get_world_size"),
              (("config", ("hsdp", "subgroup")),), no_lossy_hint=True),
        # An always-SUM comm and a bfloat16 wire are named exact causes, not lossy designs: no hint.
        Cause("bad_always_sum", "fsdp2_parity", (EXPLAINED,), no_lossy_hint=True),
        Cause("bad_bf16_wire", "fsdp2_parity", (EXPLAINED,), no_lossy_hint=True),
    ),
)


# -- lossy contracts, FSDP1 and FSDP2 -----------------------------------------------------------------

#: Specs whose declared rel_error_bound the hook exceeds: every lossy_error case must fail.
LOSSY_EXCEEDS_BOUND = ("bad_int8_exceeds_bound", "bad_int8_own_scale", "bad_lossy_bf16_wire_exceeds_bound")
#: Lossy by design but declared exact, and no exact cause explains them: told how to declare a contract.
LOSSY_UNDECLARED_UNEXPLAINED = {"bad_int8_undeclared": {"averaging", "parity"},
                                "bad_int8_comm_undeclared": {"fsdp2_parity"}}
#: More accurate than native (float32 accumulation of a bfloat16 claim), declared exact: fails parity.
LOSSY_MORE_ACCURATE = {"bad_fp32_accumulate_bf16_undeclared": {"fsdp2_parity"}}

#: Parity kept to ``nested_wrapped`` (every config and world size of it); hard inputs and clip_grad_norm_
#: left out: the exact zoo runs cover those.
LOSSY = MetaZoo(
    name="lossy",
    args=("--hook", "tests.zoo.fsdp_hooks:LOSSY", "--hook", "tests.zoo.fsdp2_comms:LOSSY", "-q",
          "-k", f"{NOT_REACH} and (lossy or registration or rank_consistency or averaging "
                "or (parity and nested_wrapped and not subgroup))"),
    bad=frozenset(s.name for s in fsdp_hooks.LOSSY_BAD + fsdp2_comms.LOSSY_BAD),
    documented=frozenset(fsdp_hooks.LOSSY_EXPECTED) | frozenset(fsdp2_comms.LOSSY_EXPECTED),
    catches=_catches({"bad_int8_exceeds_bound": {"lossy_error"}, "bad_int8_own_scale": {"lossy_error"},
                      "bad_lossy_bf16_wire_exceeds_bound": {"fsdp2_lossy_error"}})
    + _catches(LOSSY_UNDECLARED_UNEXPLAINED) + _catches(LOSSY_MORE_ACCURATE),
    good=tuple(fsdp_hooks.LOSSY_GOOD + fsdp2_comms.LOSSY_GOOD),
    causes=tuple(Cause(hook, tuple(sorted(checks)), (LOSSY_HINT, "no known cause explains the hook's result"))
                 for hook, checks in LOSSY_UNDECLARED_UNEXPLAINED.items()),
)

# -- Reach: size, horizon, topology (issue 28) -------------------------------------------------------------------

#: The checks that catch each bad hook of the reach zoo, by axis: what a size bug fails is the probe of production
#: size (its ordinary and its placed hard gradients), a horizon bug the long run, a topology bug parity on 2
#: simulated nodes.
_AXIS_CATCH = {"size": ("model", "large_probe"), "horizon": ("check", "long_run"), "topology": ("nodes", "2")}
#: Where each API's checks of the reach are named (JUnit ``check``).
_API_CHECK = {"ddp": "", "fsdp": "", "fsdp2": "fsdp2_", "fsdp2_replica": "fsdp2_replica_"}


def _reach_catches():
    out = []
    for spec in reach_hooks.KNOWN_BAD:
        by, value = _AXIS_CATCH[reach_hooks.REACH[spec.name]["axis"]]
        value = _API_CHECK[spec.api] + value if by == "check" else value
        out.append(Catch(spec.name, frozenset({value}), by))
    return tuple(out)


def _reach_selection():
    """Each hook at the cases of its own axis, the main world size only for the bad ones (the good twins also at
    3: a staged path must hold where the summation order of 3 ranks shows), and one hard-input case of the
    warm-up hook fed a dozen examples (state, not input). A bad FSDP1 hook of the size or horizon axis runs under
    FULL_SHARD alone: what the meta-tests read of it (caught by its axis's check, the step its long run names)
    one failing case shows, and each of its NO_SHARD cases, failing the same way, cost 1-9 s of shrinking or
    replay; its good twin keeps both strategies, so a false alarm under either still shows."""
    terms = []
    for spec in reach_hooks.ALL:
        axis = reach_hooks.REACH[spec.name]["axis"]
        where = {"size": "large_probe", "horizon": "long_run", "topology": TOPOLOGY_CASES}[axis]
        if axis == "topology" and spec.api == "fsdp2_replica":  # its mesh is two nodes: its own parity cases
            where = "(test_fsdp2_replica_parity and nested_wrapped)"
        if spec.name.startswith("bad_") and axis != "horizon":
            where = f"({where} and not ws3)"
        if spec.name.startswith("bad_") and spec.api == "fsdp" and axis != "topology":
            where = f"({where} and FULL_SHARD)"
        terms.append(f"({spec.name} and {where})")
    terms.append(f"(test_ddp_hard_inputs and {STATE_HOOK} and default-gradient_probe-ws2)")
    return " or ".join(terms)


#: The hook whose hard inputs, a dozen examples long, fail after its warm-up: the failure must say its state
#: after that many steps is the trigger, not the example.
STATE_HOOK = "bad_ddp_warmup_fp16"

REACH = MetaZoo(
    name="reach_hooks",
    args=("--hook", "tests.zoo.reach_hooks:ALL", "--hypothesis-examples", "12", "-q", "-k", _reach_selection()),
    bad=frozenset(s.name for s in reach_hooks.KNOWN_BAD),
    documented=frozenset(reach_hooks.EXPECTED_CATCH),
    catches=_reach_catches(),
    good=tuple(reach_hooks.KNOWN_GOOD),
    rerun=Pick("bad_ddp_skip_every_k", outcome="failed"),
)

# -- FSDP2 custom all-gather comms (set_custom_all_gather) ----------------------------------------------------

#: Every config of the all-gather API (``conformance/apis/fsdp2_all_gather/standalone.py``).
ALL_GATHER_CONFIGS = frozenset({"default", "no_reshard", "reshard_root", "hsdp", "subgroup"})
#: The configs (``config`` property) whose cases must fail for each known-bad comm; see
#: fsdp2_all_gathers.EXPECTED_CATCH. A wrong gather is wrong everywhere, but over the default group.
FSDP2_ALL_GATHER_MUST_CATCH = {
    "bad_reversed_order": ALL_GATHER_CONFIGS, "bad_cached_gather": ALL_GATHER_CONFIGS,
    "bad_bf16_wire": ALL_GATHER_CONFIGS, "bad_dropped_work": ALL_GATHER_CONFIGS, "bad_bf16_alloc": ALL_GATHER_CONFIGS,
    "bad_padding_kept": ALL_GATHER_CONFIGS,
}
#: Caught there only: over the default group (right on a 1-D mesh over the pool); x * 1.0 (hard values only).
FSDP2_ALL_GATHER_ONLY = {"bad_default_group": ("config", {"hsdp", "subgroup"}),
                         "bad_scaled_by_one": ("check", {"fsdp2_all_gather_hard_params"}),
                         "bad_global_rank_slots": ("config", {"subgroup"}),
                         "bad_chunked_drops_tail": ("model", {"large_probe"})}
#: comm -> (check, the texts its failures must carry: the cause and its fix).
FSDP2_ALL_GATHER_DIAGNOSED = {
    "bad_reversed_order": ("fsdp2_all_gather_parity", (f"{EXPLAINED} the shards in reverse rank order",
                                                        "fix: put the shard of rank r of the group in chunk r")),
    "bad_cached_gather": ("fsdp2_all_gather_parity", (f"{EXPLAINED} the gather of step 0 (stale",
                                                       "fix: gather on every call")),
    "bad_bf16_wire": ("fsdp2_all_gather_parity", (f"{EXPLAINED} the shards cast to bfloat16 on the wire",
                                                   "fix: gather input_tensor in its own dtype")),
    "bad_default_group": ("fsdp2_all_gather_parity", ("over a group of 4 ranks where FSDP2 passed it a group of 2",
                                                       "fix: pass group=group")),
    "bad_dropped_work": ("fsdp2_all_gather_parity", ("neither waited on its Work nor returned it",
                                                      "return the Work (or wait on it before returning)")),
    "bad_bf16_alloc": ("fsdp2_all_gather_parity", ("dtype=float32) returned shape (", "bfloat16 on cpu")),
    "bad_scaled_by_one": ("fsdp2_all_gather_hard_params", (f"{EXPLAINED} the same values with other bits",
                                                            "fix: copy the shards as they are")),
    "bad_padding_kept": ("fsdp2_all_gather_parity", (f"{EXPLAINED} the shards at other offsets",
                                                      "(padding of", "fix: put the shard of rank r of the group")),
    "bad_global_rank_slots": ("fsdp2_all_gather_parity", (f"{EXPLAINED} the chunks indexed by the global rank",
                                                           "fix: index the chunks by the rank in the group")),
    "bad_chunked_drops_tail": ("fsdp2_all_gather_hard_params", (f"{EXPLAINED} the shards' tails not gathered",
                                                                 "fix: put the shard of rank r of the group")),
}
#: The production-sized cases run for the chunk-loop comms only (each costs seconds; no other comm of the zoo
#: takes another path there); the comm that keeps padding runs its parity cases only (caught in every one).
_ALL_GATHER_SELECTION = ("fsdp2_all_gather and not registration and not long_run and (not large_probe or chunked) "
                         "and not (bad_chunked_drops_tail and not hard_params) "
                         "and not (bad_padding_kept and not parity)")

#: Every case of the API but the registration rules (the good comms keep them in ``tests/test_fsdp2_registration.py``)
#: and the long run: at the main world size and on the 4-rank pool (HSDP, the subgroup mesh, ``always_wrap_nested``).
FSDP2_ALL_GATHER = MetaZoo(
    name="fsdp2_all_gathers",
    args=("--hook", "tests.zoo.fsdp2_all_gathers:ALL", "--extra-world-size", "4", "-q",
          "-k", _ALL_GATHER_SELECTION),
    bad=frozenset(s.name for s in fsdp2_all_gathers.KNOWN_BAD),
    documented=frozenset(fsdp2_all_gathers.EXPECTED_CATCH),
    catches=_catches(FSDP2_ALL_GATHER_MUST_CATCH, by="config") + tuple(
        Catch(hook, frozenset(values), by, True) for hook, (by, values) in FSDP2_ALL_GATHER_ONLY.items()),
    good=tuple(fsdp2_all_gathers.KNOWN_GOOD),
    good_coverage=lambda spec: ("config", set(ALL_GATHER_CONFIGS), True),
    acting=Pick("bad_reversed_order", (("config", "default"), ("world_size", "2"))),
    acting_needles=("hook bad_reversed_order does not conform", "check=fsdp2_all_gather_parity", "config=default",
                    "model=nested_wrapped", "world_size=2", "[rank 0, step 0] call 0: the comm's output_tensor",
                    "[rank 0, step 0, parameter '", "differs from native fully_shard",
                    "FSDP2 called the all-gather comm", "over a group of 2 in float32", "Re-run just this case:",
                    "-k 'test_fsdp2_all_gather_parity[bad_reversed_order-default-nested_wrapped-ws2]'"),
    rerun=Pick("bad_cached_gather", (("config", "no_reshard"),), "failed"),
    causes=tuple(Cause(hook, check, texts, no_lossy_hint=True)
                 for hook, (check, texts) in FSDP2_ALL_GATHER_DIAGNOSED.items()),
)


# -- a claimed parameter dtype (HookSpec.param_dtype, issue 30) -------------------------------------------

#: hook -> (the checks that must catch it, whether only those).
PARAM_DTYPE_MUST_CATCH = {
    "bad_bf16_wire_params_fp32": ({"fsdp2_parity"}, False),
    "bad_fsdp_bf16_wire_params_fp32": ({"parity"}, False),
    "bad_ddp_bf16_wire_params_fp32": ({"parity"}, False),
    # One micro-batch of a bfloat16 backward is bfloat16-valued: parity passes it, accumulation catches it.
    "bad_bf16_staging_params_bf16": ({"fsdp2_accumulation"}, True),
}

#: Parity and accumulation of each API on nested_wrapped at 2 ranks: the good hooks under every config and
#: strategy there (each case trains in bfloat16), the bad ones under the default config or FULL_SHARD.
PARAM_DTYPE = MetaZoo(
    name="param_dtype_hooks",
    args=("--hook", "tests.zoo.param_dtype_hooks:ALL", "-q",
          "-k", "(test_fsdp2_parity or test_fsdp2_accumulation or test_parity or test_accumulation or test_ddp_parity "
                "or test_fsdp2_all_gather_parity) "
                "and nested_wrapped and ws2 and not 2nodes and not always_wrap "
                "and not (bad_ and not default and not FULL_SHARD)"),
    bad=frozenset(s.name for s in param_dtype_hooks.KNOWN_BAD),
    documented=frozenset(param_dtype_hooks.EXPECTED_CATCH),
    catches=tuple(Catch(hook, frozenset(checks), "check", only)
                  for hook, (checks, only) in PARAM_DTYPE_MUST_CATCH.items()),
    good=tuple(param_dtype_hooks.KNOWN_GOOD),
    good_coverage=lambda spec: ("param_dtype", {"bfloat16"}, True),
    good_outcomes=frozenset({"passed", "skipped"}),
    acting=Pick("bad_bf16_staging_params_bf16", (("check", "fsdp2_accumulation"),), "failed"),
    acting_needles=("hook bad_bf16_staging_params_bf16 does not conform", "check=fsdp2_accumulation",
                    "params=bfloat16", "with reduce_dtype=float32 and param_dtype=bfloat16",
                    "-k 'test_fsdp2_accumulation[bad_bf16_staging_params_bf16-default-nested_wrapped-"
                    "params_bfloat16-ws2]'"),
    rerun=Pick("bad_bf16_staging_params_bf16", (("check", "fsdp2_accumulation"),), "failed"),
    # The staging is named from the comm's own calls (its input rounded to bfloat16, then FSDP2's op in float32),
    # with the fix and FSDP2's reason (PR 125191): a named exact cause, so no LossyContract hint.
    causes=(Cause("bad_bf16_staging_params_bf16", "fsdp2_accumulation",
                  (f"{EXPLAINED}: the float32 input rounded to bfloat16 (cast to bfloat16 and back) before an otherwise "
                   "native reduction", "fix: reduce the input in its own dtype (float32), with no cast to bfloat16 "
                   "before the collective", "(PyTorch PR 125191)"), no_lossy_hint=True),),
)


ZOOS = (FSDP, DDP, FSDP2, LOSSY, REACH, FSDP2_ALL_GATHER, PARAM_DTYPE)
