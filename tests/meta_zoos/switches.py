"""The switch zoo's meta-run (issue 44): hooks whose other path needs two switches at once
(``tests/zoo/switch_hooks/``), at ``--depth nightly``, where the nightly's own combined case reaches them.

Each hook runs its combined case (``test_<api>_switches``); the DDP warm-up pair also its parity case of
``nested_wrapped`` at 2 ranks first, so that the ledger holds what its ordinary cases left untaken and its verdict
can say which of those branches the combined case then took. The default depth's run of the same zoo, where
every hook conforms and its switch is named as never taken, is ``tests/test_meta_switches.py``'s background job.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from tests.meta_helpers import BackgroundJob, Catch, MetaZoo, Pick, run_suite
from tests.zoo import switch_hooks

#: Where each API's combined case is named (JUnit ``check``).
SWITCH_CHECK = {"ddp": "switches", "fsdp": "switches", "fsdp2": "fsdp2_switches",
                "fsdp2_replica": "fsdp2_replica_switches"}
#: The hooks that run one ordinary case before their combined case.
WITH_ORDINARY = ("good_ddp_warm_large_staged", "bad_ddp_warm_large_bf16")
#: The good twins the nightly run takes: DDP's warm-up one, the cheapest of the combined cases (300 steps each, 9 s
#: here), whose verdict then says which branch its combined case took first. Every good twin of every API passed its
#: combined case in a run of the whole zoo (2m43s on the project's 2-core machine, 2026-12-02; docs/speed.md); make
#: test keeps the bad ones, each caught by its combined case, and this one.
NIGHTLY_GOOD = ("good_ddp_warm_large_staged",)

SWITCHES = MetaZoo(
    name="switch_hooks",
    args=("--hook", "tests.zoo.switch_hooks:ALL", "--depth", "nightly", "-q", "-k",
          "(switches and (bad_ or " + " or ".join(NIGHTLY_GOOD) + ")) "
          "or (test_ddp_parity and default-nested_wrapped-ws2 and (" + " or ".join(WITH_ORDINARY) + "))"),
    bad=frozenset(s.name for s in switch_hooks.KNOWN_BAD),
    documented=frozenset(switch_hooks.EXPECTED_CATCH),
    catches=tuple(Catch(s.name, frozenset({SWITCH_CHECK[s.api]}), "check", True) for s in switch_hooks.KNOWN_BAD),
    good=tuple(s for s in switch_hooks.KNOWN_GOOD if s.name in NIGHTLY_GOOD),
    acting=Pick("bad_fsdp2_warm_large_bf16", outcome="failed"),
    acting_needles=("hook bad_fsdp2_warm_large_bf16 does not conform", "check=fsdp2_switches",
                    "model=switch_probe_1m", "steps=300", "nodes=2", "the long run first differs at step 72 of 300",
                    "-k 'test_fsdp2_switches[bad_fsdp2_warm_large_bf16-default-switch_probe_1m-300steps-2nodes-ws2]'"),
    rerun=Pick("bad_ddp_nodes_large_local_divisor", outcome="failed"),
)


# -- the default depth, measured and not (tests/test_meta_switches.py, tests/test_hook_code_bits.py) ---------------

#: The hooks of the default depth's runs: the switch zoo and the identity zoo, with DDP's arithmetic zoo, FSDP2
#: comms and a bfloat16-on-the-wire comm besides, whose failures carry diagnoses to compare bit for bit.
DEFAULT_HOOKS = ("tests.zoo.switch_hooks:ALL", "tests.zoo.identity_hooks:ALL", "tests.zoo.ddp_hooks.good:KNOWN_GOOD",
                 "tests.zoo.ddp_hooks.arithmetic:KNOWN_BAD", "tests.zoo.fsdp2_comms.reduce_scatter:KNOWN_GOOD",
                 "tests.zoo.param_dtype_hooks:KNOWN_BAD")
#: Each switch hook's parity on ``nested_wrapped`` at 2 ranks (and on 2 simulated nodes: a nodes x size hook takes
#: its node side there, never its size side), the replica's parity (4 ranks as 2 nodes), the long run of each bad
#: warm-up hook (256 steps: its warm side, never its size side); the identity hooks' parity at 2 and 4 ranks
#: (their exchange), and a sample of failures with a named cause.
_SWITCH = " or ".join(f"{spec.name}-" for spec in switch_hooks.ALL)
DEFAULT_SELECTION = (
    f"((test_ddp_parity or test_parity or test_fsdp2_parity) and nested_wrapped and ws2 and (default or NO_SHARD) "
    f"and ({_SWITCH})) or (test_fsdp2_replica_parity and ({_SWITCH} or good_replica_p2p_exchange-)) "
    f"or (long_run and ws2 and not 2nodes and ({_SWITCH}) and bad_ and warm) "
    "or (good_ddp_p2p_exchange- and test_ddp_parity and nested_wrapped and (ws2 or ws4) and not ws3) "
    "or (test_ddp_parity and default-nested_wrapped-ws3 and (good_mean_allreduce- or good_state_object- "
    "or bad_sum_then_divide- or bad_stale_second_step- or bad_rank_order_mean- or bad_ring_no_average_tail-)) "
    "or (test_fsdp2_parity and default-nested_wrapped-ws2 and (good_plain_instance- or good_async_wait- "
    "or bad_bf16_wire_params_fp32-))")


#: The cases run again with the measurement off, to compare bit for bit (``tests/test_hook_code_bits.py``): the
#: failures with a named cause, the long runs of stateful hooks, the exchanges by ``P2POp``, and a parity case of
#: each switch API.
OFF_SELECTION = (
    "(test_ddp_parity and default-nested_wrapped-ws3) or (test_fsdp2_parity and bad_bf16_wire_params_fp32-) "
    "or (long_run and (bad_ddp_warm_large_bf16- or bad_fsdp2_warm_large_bf16-)) "
    "or (p2p_exchange and (default-nested_wrapped-ws2 or replica)) "
    "or (parity and ws2 and not 2nodes and (good_fsdp_warm_large_async- and NO_SHARD or good_fsdp2_warm_large_staged-))")


def _default_runs(runs: object, directory: str, env: Dict[str, str]) -> Dict[str, Any]:
    """The default depth's run of :data:`DEFAULT_HOOKS` with ``--hook-coverage on``, and those of its cases
    :data:`OFF_SELECTION` picks with it ``off``: ``{"on": (run, results document), "off": ...}``."""
    out = {}
    for coverage in ("on", "off"):
        path = os.path.join(directory, f"default_{coverage}.json")
        args = [a for h in DEFAULT_HOOKS for a in ("--hook", h)]
        selection = DEFAULT_SELECTION if coverage == "on" else f"({DEFAULT_SELECTION}) and ({OFF_SELECTION})"
        run = run_suite([*args, "-q", "-k", selection, "--hook-coverage", coverage, "--json", path],
                        os.path.join(directory, f"default_{coverage}.xml"), timeout=900, env=env)
        with open(path, encoding="utf-8") as f:
            out[coverage] = (run, json.load(f))
    return out


#: Both runs, in the zoo runs' background threads (``tests/conftest.py``).
DEFAULT_RUNS = BackgroundJob("switch_hooks_default", _default_runs)
