"""Replays of a failed case that tell the hook's failure from one it is not to blame for.

* :func:`replay_reference`: a rank failed inside the suite's own reference: train the reference alone; the
  case is a skip when it fails there too (PyTorch cannot run it here).
* :func:`replay_default_hook`: findings that name no cause of the hook's own: replay the case with PyTorch's
  own default hook for it (:mod:`conformance.controller.default_replay`); a skip when it shows the same
  difference, or when a reference caveat of this torch version explains it.
* :func:`lost_a_rank`: a rank died (or, under torchrun, was lost): the runner runs the case once more in
  fresh ranks before anything else (:class:`CrashRerun`); the second run is the case's.
* :func:`replay_crash`: a rank raised, hung or died outside the reference: replay the case with PyTorch's own
  default hook for it, in ranks of their own; ``NOT RUN`` when that fails the same way (the machine, the
  suite or this torch cannot run the case, whatever the hook).

They run on the runner's pools (:meth:`~conformance.controller.runner.Runner.run_replay`) and skip with
``pytest.skip`` or :class:`NotRun`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import pytest
import torch

from conformance.apis.registry import HOOK_APIS
from conformance.controller import default_replay
from conformance.controller.across_ranks import findings_of
from conformance.controller.failures import NotRun
from conformance.controller.pools import Pool, PoolStartError
from conformance.protocol import Case, CaseResult, Finding, HookRef, RankOutcome
from conformance.reports import report

__all__ = ["CrashRerun", "RERUN_DIED", "RERUN_FAILED", "RERUN_FINISHED", "RERUN_NOT_STARTED", "crash_signatures",
           "first_loss", "lost_a_rank", "replay_crash", "replay_default_hook", "replay_reference",
           "second_run_outcome"]


#: How the re-run after a dead rank went (:attr:`CrashRerun.second_run`).
RERUN_FINISHED = "ran to the end"
RERUN_DIED = "a rank died again"
RERUN_FAILED = "a rank raised or hung"
RERUN_NOT_STARTED = "could not start"


@dataclasses.dataclass(frozen=True)
class CrashRerun:
    """A case whose rank died, run once more in fresh ranks (:meth:`conformance.controller.runner.Runner.run`).

    A rank that dies takes its pool with it, so the second run gets ranks that ran nothing before it: not
    the hook's earlier cases, not what an earlier case left in its process groups. The second run is the
    case's result; this record keeps the first for the hook's verdict line, the summary and the results
    file. Whether the death was the machine's, an earlier case's or the hook's own (a hook that crashes
    now and then) the suite cannot tell: it says so, and grants the re-run once per hook.

    Attributes:
        case: the test name (``item.name``).
        hook: the hook's spec name, or ``None``.
        dead_rank: the first run's dead rank, on one line (``RankOutcome.summary``; :func:`first_loss`).
        printed: the first line that rank printed during the case (``""``: none).
        first_run: what the first run's ranks did (:func:`conformance.reports.report.rank_problems`).
        second_run: :data:`RERUN_FINISHED` (every rank finished; the case's outcome is what it found),
            :data:`RERUN_DIED`, :data:`RERUN_FAILED` (the case's failure is the second run's), or
            :data:`RERUN_NOT_STARTED` (no fresh ranks, torchrun's restarts spent say: the first run stands).
    """

    case: str
    hook: Optional[str]
    dead_rank: str
    printed: str
    first_run: str
    second_run: str

    @property
    def death(self) -> str:
        """The dead rank and what it printed first, on one line."""
        return self.dead_rank + (f" (it printed: {self.printed})" if self.printed else "")

    def to_json(self) -> Dict[str, Any]:
        return {"case": self.case, "hook": self.hook, "death": self.death, "first_run": self.first_run,
                "second_run": self.second_run}


def second_run_outcome(result: CaseResult) -> str:
    """:attr:`CrashRerun.second_run` of the re-run ``result``."""
    if lost_a_rank(result):
        return RERUN_DIED
    return RERUN_FINISHED if all(o.ok for o in result.outcomes) else RERUN_FAILED


def lost_a_rank(result: CaseResult) -> bool:
    """Whether a rank of ``result`` died or was lost (not one that raised or hung) and the pool was rebuilt:
    the case can run again in ranks of its own at the cost of one pool start. A process that dies does so
    for a reason of its own process (a signal, a C++ abort from an unmatched collective, the machine), which
    may come from before the case; an exception or a hang is the case's own, and is not re-run."""
    return result.pool_rebuilt and any(o.exit_code is not None or o.lost for o in result.outcomes if not o.ok)


def first_loss(result: CaseResult) -> Tuple[str, str]:
    """The first dead or lost rank of ``result``: its summary line, and the first line of its output (``""``)."""
    o = next(o for o in result.outcomes if not o.ok and (o.exit_code is not None or o.lost))
    return o.summary(), next((line.strip() for line in (o.output or "").splitlines() if line.strip()), "")


def _default_hook(runner: Any, hook: str, params: Dict[str, Any], world_size: int) -> Tuple[Any, Optional[str], bool]:
    """``(api, name, itself)``: the hook's API, the name of PyTorch's own default hook for the case
    (``HookApi.default_hook``; ``None`` where the API names none), and whether the hook under test is that
    very built-in hook."""
    item = runner.specs[hook]
    api = HOOK_APIS[item.spec.api]
    name = default_replay.default_hook_name(api, item.spec, params, world_size)
    return api, name, name is not None and item.target == api.builtin_hooks and hook == name


def _run_default_hook(runner: Any, api: Any, name: str, check: str, params: Dict[str, Any], world_size: int,
                      case_id: str, nodes: int = 1) -> CaseResult:
    """Run ``check`` with PyTorch's default hook ``name`` in ranks of its own (serving no hook under test), as
    every hook's cases run; its spec is loaded there on first use. The hook's next case gets its own ranks
    again."""
    return runner.run_replay(runner.pool(world_size, hook=None), Case(
        check=check, hook=HookRef(target=api.builtin_hooks, name=name), params=params, case_id=case_id,
        nodes=nodes))


def replay_default_hook(runner: Any, case: Any, rank_check: str, params: Dict[str, Any], found: List[Finding],
                         across_ranks: bool) -> str:
    """Skip a failure that any hook would get here (:mod:`conformance.controller.default_replay`): one a reference
    caveat of this torch version explains, or that PyTorch's own default hook for the case shows too
    (replayed on the same pool, or the hook under test itself). Else the failure's closing note."""
    __tracebackhide__ = True
    version = torch.__version__
    caveat = default_replay.caveat_for(rank_check, params, found, version)
    if caveat is not None:
        pytest.skip(default_replay.caveat_reason(caveat, found, version))
    api, name, itself = _default_hook(runner, case.hook, params, case.world_size)
    if name is None:
        return ""
    if itself:  # the evidence is this very failure
        if default_replay.after_the_hook_returned(found):
            pytest.skip(default_replay.default_hook_reason(name, found, version, itself=True))
        return ""
    result = _run_default_hook(runner, api, name, rank_check, params, case.world_size,
                               f"{case.hook} case replayed with {name}", nodes=case.nodes)
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
    result = runner.run_replay(pool, dataclasses.replace(case, params={**case.params, "reference_only": True}))
    bad = [o for o in result.outcomes if not o.ok]
    if bad:
        what = " ".join(f"{k}={v}" for k, v in describe.items())
        pytest.skip(f"the suite's reference ({what}, no hook under test) cannot run here with torch "
                    f"{torch.__version__}: rank {bad[0].rank} {bad[0].summary().split(': ', 1)[-1]}: "
                    f"{report.exception_line(bad[0].error or bad[0].stack or '')}")
    return ("\n(the reference trained alone, with no hook, runs here: the failure above comes from "
            "training it beside the hooked model)")


def _signature(o: RankOutcome, timed_out: bool) -> Tuple[str, ...]:
    """How one rank did not finish: raised (phase, exception type, its line with addresses blanked), hung
    (phase), died (phase, exit code) or was lost."""
    if o.error is not None:
        line = re.sub(r"0x[0-9a-fA-F]+", "0x...", report.exception_line(o.error))
        return ("raised", o.phase, o.error_type or "", line)
    if o.stack is not None or timed_out:
        return ("hung", o.phase)
    if o.exit_code is not None:
        return ("died", o.phase, str(o.exit_code))
    return ("lost", o.phase)


def crash_signatures(result: CaseResult) -> FrozenSet[Tuple[str, ...]]:
    """How the ranks of ``result`` that did not finish failed (:func:`_signature`), as a set: two runs of a case
    failed the same way where they share one."""
    return frozenset(_signature(o, result.timed_out) for o in result.outcomes if not o.ok)


def _describe(signature: Tuple[str, ...]) -> str:
    kind, phase, *rest = signature
    if kind == "raised":
        what = f"raised {rest[-1]}"
    elif kind == "died":
        what = f"died (exit code {rest[0]})"
    else:
        what = "hung" if kind == "hung" else "was lost"
    return f"a rank {what} during {phase!r}"


def replay_crash(runner: Any, case: Case, world_size: int, params: Dict[str, Any], result: CaseResult,
                 problems: str) -> str:
    """A rank raised, hung or died while the hook's model trained: is that the hook's doing?

    Replays the case with PyTorch's own default hook for it (``HookApi.default_hook``) in ranks of their own,
    once per case shape (the replay's outcome is kept for the session). Where it fails the same way (a rank
    that raised the same exception in the same phase, hung or died in the same phase: :func:`crash_signatures`),
    the case is :class:`NotRun`: the machine, the suite or this torch cannot run it, whatever the hook (a GPU
    machine once failed every forked rank's first backward pass; PyTorch's hooks blamed). Where the hook
    under test is itself that default hook, it is its own evidence: ``NOT RUN`` too. Else the failure stands,
    and the note returned says so. No default hook for the case (an API without one): ``""``, it stands.
    """
    __tracebackhide__ = True
    api, name, itself = _default_hook(runner, case.hook.name, params, world_size)
    if name is None:
        return ""
    mine = crash_signatures(result)
    whose = f"the run's failure (this machine's, the suite's or torch {torch.__version__}'s), not the hook's"
    if itself:
        raise NotRun(f"PyTorch's own default hook for this case ({name}, the hook under test) cannot run it here: "
                     f"{_describe(min(mine))}; {whose}", detail=problems)
    key = (case.check, name, world_size, repr(sorted(params.items())))
    theirs = runner.crash_replays.get(key)
    if theirs is None:
        try:
            replayed = _run_default_hook(runner, api, name, case.check, params, world_size,
                                         f"{case.case_id} replayed with {name}", nodes=case.nodes)
        except PoolStartError as exc:  # no evidence either way: the failure stands, and says so
            return f"\n(PyTorch's own default hook for this case, {name}, could not be replayed: {exc})"
        theirs = runner.crash_replays[key] = crash_signatures(replayed)
    same = mine & theirs
    if same:
        raise NotRun(f"PyTorch's own default hook for this case ({name}), replayed in ranks of its own, fails it "
                     f"the same way: {_describe(min(same))}; {whose}", detail=problems)
    how = "runs it to the end" if not theirs else f"fails it otherwise ({_describe(min(theirs))})"
    return (f"\n(PyTorch's own default hook for this case, {name}, replayed in ranks of its own, {how}: "
            "what failed above is this hook's doing)")
