"""The FSDP2 zoos' meta-runs: the reduce-scatter comms, all-reduce hooks and replica hooks
(``tests/zoo/fsdp2_comms/``), and the all-gather comms (``tests/zoo/fsdp2_all_gathers.py``); for each, its
arguments, the configs or checks that must catch each bad hook and the causes its failures must name.
"""

from __future__ import annotations

import torch

from tests.meta_helpers import Catch, Cause, MetaZoo, Pick
from tests.meta_zoos.common import EXPLAINED, NOT_REACH, _catches
from tests.zoo import fsdp2_all_gathers, fsdp2_comms

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
