"""Replays of a failed case that tell the hook's failure from one it is not to blame for.

* :func:`replay_reference`: a rank failed inside the suite's own reference: train the reference alone; the
  case is a skip when it fails there too (PyTorch cannot run it here).
* :func:`replay_default_hook`: findings that name no cause of the hook's own: replay the case with PyTorch's
  own default hook for it (:mod:`conformance.controller.default_replay`); a skip when it shows the same
  difference, or when a reference caveat of this torch version explains it.

Both run on the runner's pools (``runner._replay``) and skip with ``pytest.skip``.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from conformance.apis.registry import HOOK_APIS
from conformance.controller import default_replay
from conformance.controller.across_ranks import findings_of
from conformance.controller.pools import Pool
from conformance.protocol import Case, Finding, HookRef
from conformance.reports import report

__all__ = ["replay_default_hook", "replay_reference"]


def replay_default_hook(runner: Any, case: Any, rank_check: str, params: Dict[str, Any], found: List[Finding],
                         across_ranks: bool) -> str:
    """Skip a failure that any hook would get here (:mod:`conformance.controller.default_replay`): one a reference
    caveat of this torch version explains, or that PyTorch's own default hook for the case shows too
    (replayed on the same pool, or the hook under test itself). Else the failure's closing note."""
    __tracebackhide__ = True
    version, item = torch.__version__, runner.specs[case.hook]
    caveat = default_replay.caveat_for(rank_check, params, found, version)
    if caveat is not None:
        pytest.skip(default_replay.caveat_reason(caveat, found, version))
    api = HOOK_APIS[item.spec.api]
    name = default_replay.default_hook_name(api, item.spec, params, case.world_size)
    if name is None:
        return ""
    if item.target == api.builtin_hooks and case.hook == name:  # the evidence is this very failure
        if default_replay.after_the_hook_returned(found):
            pytest.skip(default_replay.default_hook_reason(name, found, version, itself=True))
        return ""
    # In ranks of its own (serving no hook under test), as every hook's cases run; the default hook's
    # spec is loaded there on first use. The hook's next case gets its own ranks again.
    result = runner._replay(runner.pool(case.world_size, hook=None), Case(
        check=rank_check, hook=HookRef(target=api.builtin_hooks, name=name), params=params,
        case_id=f"{case.hook} case replayed with {name}"))
    theirs = findings_of(result, across_ranks) if result.all_ok else []
    if result.all_ok and default_replay.same_difference(found, theirs):
        pytest.skip(default_replay.default_hook_reason(name, found, version, itself=False))
    if not default_replay.after_the_hook_returned(found):
        return ""
    return "  " + default_replay.default_hook_note(name, theirs, result.all_ok)


def replay_reference(runner: Any, pool: Pool, case: Case, describe: Dict[str, Any]) -> str:
    """Train the reference alone; skip the case if it fails there too, else say the hook broke it.

    The suite never blames a hook for its own reference: a reference that
    PyTorch cannot run here (a bug of this torch version, say) makes the
    case a skip with the reference's error as the reason.
    """
    __tracebackhide__ = True
    result = runner._replay(pool, Case(check=case.check, hook=case.hook,
                                       params={**case.params, "reference_only": True}, case_id=case.case_id))
    bad = [o for o in result.outcomes if not o.ok]
    if bad:
        what = " ".join(f"{k}={v}" for k, v in describe.items())
        pytest.skip(f"the suite's reference ({what}, no hook under test) cannot run here with torch "
                    f"{torch.__version__}: rank {bad[0].rank} {bad[0].summary().split(': ', 1)[-1]}: "
                    f"{report.exception_line(bad[0].error or bad[0].stack or '')}")
    return ("\n(the reference trained alone, with no hook, runs here: the failure above comes from "
            "training it beside the hooked model)")
