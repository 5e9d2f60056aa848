"""The meta-runs, as data: each zoo, the arguments it runs with, and what its JUnit XML must show.

``tests/test_meta.py`` holds the meta-test shape once, parametrized over ``ZOOS``; the few tests truly
specific to one API read the same run (``tests/conftest.py``: one run per zoo per session) from
``tests/test_meta_fsdp.py``, ``test_meta_ddp.py``, ``test_meta_fsdp2.py`` and ``test_meta_lossy.py``.
Each zoo module's ``EXPECTED_CATCH`` (or ``LOSSY_EXPECTED``) says why each catch below must hold.

One module per API: ``fsdp.py`` (FSDP1), ``ddp.py``, ``fsdp2.py`` (the FSDP2 comms and hooks, and the all-gather
comms), ``across_apis.py`` (the lossy contracts, the reach, a claimed parameter dtype) and ``switches.py`` (where
two switches meet), over what they share
(``common.py``). This module gathers them: every name a test reads is importable from ``tests.meta_zoos``.
"""

from __future__ import annotations

from tests.meta_zoos.across_apis import (LOSSY, LOSSY_EXCEEDS_BOUND, LOSSY_MORE_ACCURATE,
                                         LOSSY_UNDECLARED_UNEXPLAINED, PARAM_DTYPE, PARAM_DTYPE_MUST_CATCH, REACH,
                                         STATE_HOOK)
from tests.meta_zoos.common import EXPLAINED, LOSSY_HINT, NOT_REACH, REACH_CASES, TOPOLOGY_CASES
from tests.meta_zoos.ddp import DDP, DDP_CAUSES, DDP_EXACT_CHECKS, DDP_LOSSY_CHECKS, DDP_MUST_CATCH, NATIVE_MODES
from tests.meta_zoos.fsdp import FSDP, FSDP_CAUSES, FSDP_DIAGNOSED, FSDP_MUST_CATCH
from tests.meta_zoos.fsdp2 import (ALL_GATHER_CONFIGS, FSDP2, FSDP2_ALL_GATHER, FSDP2_ALL_GATHER_DIAGNOSED,
                                   FSDP2_ALL_GATHER_MUST_CATCH, FSDP2_ALL_GATHER_ONLY, FSDP2_DIAGNOSED,
                                   FSDP2_MUST_CATCH, FSDP2_MUST_CATCH_BY_CHECK, FSDP2_MUST_CATCH_WITH_PREMUL_SUM,
                                   REPLICA_DIAGNOSED)
from tests.meta_zoos.switches import DEFAULT_RUNS as SWITCH_DEFAULT_RUNS, SWITCHES

#: Every meta-run, in the order the shared meta-tests (``tests/test_meta.py``) take them.
ZOOS = (FSDP, DDP, FSDP2, LOSSY, REACH, FSDP2_ALL_GATHER, PARAM_DTYPE, SWITCHES, NATIVE_MODES)
