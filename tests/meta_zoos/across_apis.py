"""The meta-runs whose zoos span the APIs: the lossy contracts (FSDP1 and FSDP2), the suite's reach (size, horizon,
topology: ``tests/zoo/reach_hooks/``) and a claimed parameter dtype (``tests/zoo/param_dtype_hooks.py``); for
each, its arguments, what must catch each bad hook and the causes its failures must name.
"""

from __future__ import annotations

from tests.meta_helpers import Catch, Cause, MetaZoo, Pick
from tests.meta_zoos.common import EXPLAINED, LOSSY_HINT, NOT_REACH, TOPOLOGY_CASES, _catches
from tests.zoo import fsdp2_comms, fsdp_hooks, param_dtype_hooks, reach_hooks

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
