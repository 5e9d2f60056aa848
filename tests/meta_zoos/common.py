"""What the meta-runs of every API share: the texts a diagnosis must carry, the cases of the suite's reach (which
only the reach zoo runs), and how a table of catches becomes ``Catch`` es and a ``-k`` clause.
"""

from __future__ import annotations

from tests.meta_helpers import Catch

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
