"""The switch zoo's meta-run (issue 44): hooks whose other path needs two switches at once
(``tests/zoo/switch_hooks/``), at ``--depth nightly``, where the nightly's own combined case reaches them.

Each hook runs its combined case (``test_<api>_switches``); the DDP warm-up pair also its parity case of
``nested_wrapped`` at 2 ranks first, so that the ledger holds what its ordinary cases left untaken and its verdict
can say which of those branches the combined case then took. The default depth's run of the same zoo, where
every hook conforms and its switch is named as never taken, is ``tests/test_meta_switches.py``'s background job.
"""

from __future__ import annotations

from tests.meta_helpers import Catch, MetaZoo, Pick
from tests.zoo import switch_hooks

#: Where each API's combined case is named (JUnit ``check``).
SWITCH_CHECK = {"ddp": "switches", "fsdp": "switches", "fsdp2": "fsdp2_switches",
                "fsdp2_replica": "fsdp2_replica_switches"}
#: The hooks that run one ordinary case before their combined case.
WITH_ORDINARY = ("good_ddp_warm_large_staged", "bad_ddp_warm_large_bf16")

SWITCHES = MetaZoo(
    name="switch_hooks",
    args=("--hook", "tests.zoo.switch_hooks:ALL", "--depth", "nightly", "-q", "-k",
          "switches or (test_ddp_parity and default-nested_wrapped-ws2 and ("
          + " or ".join(WITH_ORDINARY) + "))"),
    bad=frozenset(s.name for s in switch_hooks.KNOWN_BAD),
    documented=frozenset(switch_hooks.EXPECTED_CATCH),
    catches=tuple(Catch(s.name, frozenset({SWITCH_CHECK[s.api]}), "check", True) for s in switch_hooks.KNOWN_BAD),
    good=tuple(switch_hooks.KNOWN_GOOD),
    acting=Pick("bad_fsdp2_warm_large_bf16", outcome="failed"),
    acting_needles=("hook bad_fsdp2_warm_large_bf16 does not conform", "check=fsdp2_switches",
                    "model=switch_probe_1m", "steps=300", "nodes=2", "the long run first differs at step 72 of 300",
                    "-k 'test_fsdp2_switches[bad_fsdp2_warm_large_bf16-default-switch_probe_1m-300steps-2nodes-ws2]'"),
    rerun=Pick("bad_ddp_nodes_large_local_divisor", outcome="failed"),
)
