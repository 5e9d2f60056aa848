"""The FSDP1 zoo's meta-run (``tests/zoo/fsdp_hooks/``): its arguments, the checks that must catch each bad hook
and the causes its failures must name.
"""

from __future__ import annotations

import torch

from tests.meta_helpers import Cause, MetaZoo, Pick
from tests.meta_zoos.common import EXPLAINED, NOT_REACH, _bad_hooks_only_at, _catches
from tests.zoo import fsdp_hooks

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
                     "subgroup_parity", "clip_grad_norm", "second_model"} | low_precision, True


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
