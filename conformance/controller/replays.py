"""What the runner replays of a failed case, the runs a case's attribution asks for, and the record of a case
run again in fresh ranks.

After a failure the runner may run the case again in two ways:

* with the **reference alone** (``reference_only=True``): the check builds and trains only its reference
  model (the native path, no hook), so the controller can tell a reference that PyTorch cannot run here
  (a skip) from a hook that broke it (a failure). Only a check that takes ``reference_only`` can
  (:data:`REPLAYS_REFERENCE`);
* with **PyTorch's default hook** in the hook's place (:mod:`conformance.controller.default_replay`): where
  the check runs the same with any spec of its API and its reference is PyTorch's behaviour on this
  torch version, a failure that no cause of the hook's own explains may be PyTorch's (:data:`REPLAYS_DEFAULT_HOOK`).

The rank side only runs what it is asked; which of its shared checks are replayed each says in its entry of
the check catalogue (:attr:`conformance.catalogue.CheckEntry.replay_reference` and ``replay_default_hook``), read
here. ``tests/test_reference_replay.py`` holds every name of :data:`REFERENCE_REPLAYABLE` to a check that takes
``reference_only``.

Who is to blame for a case is decided by :func:`conformance.controller.attribution.attribute`, a pure function of
the case's runs; this module runs what it asks for, on the runner's pools
(:meth:`~conformance.controller.runner.Runner.run_on`):

* :func:`case_facts`: what the attribution needs of a case beside its runs (PyTorch's own default hook for it,
  the torch version, whether the check replays its reference or the default hook);
* :func:`replay`: a :class:`~conformance.controller.attribution.Replay` of the case, as a
  :class:`~conformance.controller.attribution.Run`: the reference alone (``reference_only=True``, on the same
  pool; once more to check native against itself), or PyTorch's own default hook in the hook's place (in ranks
  of their own; once per case shape, kept for the session), or the case again in fresh ranks (the case's own
  run, where it starts).
* :class:`CrashRerun`: a case whose rank died by a signal, run once more in fresh ranks: the hook's verdict
  line, the summary and the results file show it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Protocol, Tuple

import torch

from conformance.apis.registry import HOOK_APIS
from conformance.controller import default_replay
from conformance.controller.attribution import CaseFacts, Replay, Run, first_loss, lost_a_rank
from conformance.controller.failures import NotRun
from conformance.controller.pools import Pool, PoolStartError
from conformance.protocol import Case, CaseResult, Finding, HookRef
from conformance.catalogue import CATALOGUE
from conformance.reports import report

if TYPE_CHECKING:  # pragma: no cover
    from conformance.apis import HookApi

__all__ = ["CrashRerun", "DEFAULT_HOOK_REPLAYABLE", "REFERENCE_REPLAYABLE", "REPLAYS_DEFAULT_HOOK", "REPLAYS_REFERENCE",
           "RERUN_DIED", "RERUN_FAILED", "RERUN_FINISHED", "RERUN_NOT_STARTED", "ReplayRunner", "case_facts", "replay",
           "second_run_outcome"]

#: The shared checks replayed with their reference alone: each takes ``reference_only=True``.
REFERENCE_REPLAYABLE: FrozenSet[str] = frozenset(name for name, e in CATALOGUE.items() if e.replay_reference)
#: The shared checks replayed with PyTorch's own default hook: each runs the same with any spec of its API,
#: and its reference is PyTorch's behaviour on this torch version.
DEFAULT_HOOK_REPLAYABLE: FrozenSet[str] = frozenset(name for name, e in CATALOGUE.items() if e.replay_default_hook)


def _registered(shared: FrozenSet[str]) -> FrozenSet[str]:
    """The registered names (``<api>.<check>``) of the shared checks in ``shared`` that any API's suite tests
    run (:data:`conformance.apis.registry.HOOK_APIS`)."""
    return frozenset(test.rank_check_name for api in HOOK_APIS.values() for test in api.plans.values()
                     if test.rank_check in shared)


#: Rank checks (``"fsdp.parity"``) the runner replays with ``reference_only=True``.
REPLAYS_REFERENCE = _registered(REFERENCE_REPLAYABLE)
#: Rank checks the runner may replay with PyTorch's own default hook.
REPLAYS_DEFAULT_HOOK = _registered(DEFAULT_HOOK_REPLAYABLE)


class ReplayRunner(Protocol):
    """What the replays need of the runner (:class:`~conformance.controller.runner.Runner`), and all they may
    use: its pools, its two ways to run a case, and the records it keeps of replays."""

    specs: Mapping[str, Any]  # spec name -> the loaded spec item (``.spec``, ``.target``)
    not_run: Dict[Tuple[Optional[str], int], str]  # (hook, world size) -> why its pool could not start
    crash_replays: Dict[Tuple[Any, ...], Any]  # the default hook's runs, by case shape, for the session
    crash_reruns: List[Any]  # the :class:`CrashRerun` records

    def pool(self, world_size: int, hook: Optional[str] = None) -> Pool:
        """The pool of ``world_size`` ranks for ``hook``'s cases (``None``: ranks that load no hook)."""

    def run_on(self, pool: Pool, case: Case, *, own: bool = True) -> CaseResult:
        """``case`` on ``pool``: the case's own run (``own``; raises ``NotRun`` where the pool cannot start), or a
        replay (another hook, or the reference alone; raises ``PoolStartError`` there)."""


#: How the re-run after a dead rank went (:attr:`CrashRerun.second_run`).
RERUN_FINISHED = "ran to the end"
RERUN_DIED = "a rank died again"
RERUN_FAILED = "a rank raised or hung"
RERUN_NOT_STARTED = "could not start"


@dataclasses.dataclass(frozen=True)
class CrashRerun:
    """A case whose rank died by a signal (or was lost), run once more in fresh ranks
    (:meth:`conformance.controller.runner.Runner.run`, as :func:`~conformance.controller.attribution.attribute`
    asks).

    A rank that dies takes its pool with it, so the second run gets ranks that ran nothing before it: not
    the hook's earlier cases, not what an earlier case left in its process groups. The second run is the
    case's result; this record keeps the first for the hook's verdict line, the summary and the results
    file. Whether a death by a signal was the machine's, an earlier case's or the hook's own (a hook that
    crashes now and then) the suite cannot tell: it says so, and grants the re-run once per hook. A rank that
    ended its own process (an exit status of its own) is the hook's doing and is not re-run.

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


def _default_hook(runner: ReplayRunner, hook: str, params: Dict[str, Any],
                  world_size: int) -> Tuple[Any, Optional[str], bool]:
    """``(api, name, itself)``: the hook's API, the name of PyTorch's own default hook for the case
    (``ControllerSide.default_hook``; ``None`` where the API names none), and whether the hook under test is that
    very built-in hook."""
    item = runner.specs[hook]
    api = HOOK_APIS[item.spec.api]
    name = default_replay.default_hook_name(api, item.spec, params, world_size)
    return api, name, name is not None and item.target == api.builtin_hooks and hook == name


def _run_default_hook(runner: ReplayRunner, api: HookApi, name: str, check: str, params: Dict[str, Any],
                      world_size: int, case_id: str, nodes: int = 1) -> CaseResult:
    """Run ``check`` with PyTorch's default hook ``name`` in ranks of its own (serving no hook under test), as
    every hook's cases run; its spec is loaded there on first use. The hook's next case gets its own ranks
    again."""
    return runner.run_on(runner.pool(world_size, hook=None), Case(
        check=check, hook=HookRef(target=api.builtin_hooks, name=name), params=params, case_id=case_id,
        nodes=nodes), own=False)


def case_facts(runner: ReplayRunner, case: Case, world_size: int, described: Dict[str, Any],
               known_failure: bool, claims_exactness: bool = False) -> CaseFacts:
    """The attribution's :class:`~conformance.controller.attribution.CaseFacts` of ``case`` (``described``: what the
    case is, shown in reasons), read from the runner's specs, the API's default hook and this torch."""
    hook = case.hook.name if case.hook is not None else None
    name, itself = None, False
    if hook is not None:
        _, name, itself = _default_hook(runner, hook, case.params, world_size)
    return CaseFacts(check=case.check, hook=hook, what=" ".join(f"{k}={v}" for k, v in described.items()),
                     known_failure=known_failure, rerun_spent=any(r.hook == hook for r in runner.crash_reruns),
                     replays_reference=case.check in REPLAYS_REFERENCE,
                     replays_default_hook=case.check in REPLAYS_DEFAULT_HOOK, default_hook=name,
                     is_default_hook=itself, torch_version=torch.__version__, params=dict(case.params),
                     claims_exactness=claims_exactness)


def replay(runner: ReplayRunner, asked: Replay, case: Case, world_size: int, pool: Pool,
           judge: Callable[[CaseResult], List[Finding]], first: CaseResult) -> Run:
    """Run the replay ``asked`` of ``case`` (whose first run was ``first``), its findings judged by ``judge``
    where every rank finished: :attr:`Replay.CRASH_RERUN` on the case's ``pool`` (rebuilt: fresh ranks), kept in
    the runner's ``crash_reruns``; :attr:`Replay.REFERENCE` and :attr:`Replay.REFERENCE_AGAIN` on ``pool``;
    :attr:`Replay.DEFAULT_HOOK` in ranks of their own, kept in the runner's ``crash_replays`` for the session, by
    case shape. A replay whose ranks cannot start is a :class:`Run` with no result, saying why."""
    __tracebackhide__ = True
    if asked is Replay.CRASH_RERUN:
        return _rerun(runner, pool, case, world_size, judge, first)
    try:
        if asked in (Replay.REFERENCE, Replay.REFERENCE_AGAIN):
            reference_only = dataclasses.replace(case, params={**case.params, "reference_only": True})
            result = runner.run_on(pool, reference_only, own=False)
            return Run(asked, result)
        if asked is not Replay.DEFAULT_HOOK:
            raise ValueError(f"not a replay of this module: {asked}")
        api, name, _ = _default_hook(runner, case.hook.name, case.params, world_size)
        key = (case.check, name, world_size, repr(sorted(case.params.items())))
        if key not in runner.crash_replays:
            result = _run_default_hook(runner, api, name, case.check, case.params, world_size,
                                       f"{case.case_id} replayed with {name}", nodes=case.nodes)
            runner.crash_replays[key] = Run(asked, result, tuple(judge(result)) if result.all_ok else ())
        return runner.crash_replays[key]
    except PoolStartError as exc:  # no evidence either way: the attribution says so
        return Run(asked, None, not_started=str(exc))


def _rerun(runner: ReplayRunner, pool: Pool, case: Case, world_size: int, judge: Callable[[CaseResult], List[Finding]],
           first: CaseResult) -> Run:
    """The case once more, as the case's own run (counted, :class:`NotRun` where its pool failed before), in the
    fresh ranks of the rebuilt pool; kept in the runner's ``crash_reruns`` (:class:`CrashRerun`)."""
    __tracebackhide__ = True
    hook = case.hook.name if case.hook is not None else None
    try:
        result = runner.run_on(pool, case)
    except NotRun:  # no fresh ranks (torchrun's restarts spent, say): no evidence, the first run stands
        why = (runner.not_run.get((hook, world_size)) or "").strip().splitlines()
        run, second = Run(Replay.CRASH_RERUN, None, not_started=why[0] if why else ""), RERUN_NOT_STARTED
    else:
        run = Run(Replay.CRASH_RERUN, result, tuple(judge(result)) if result.all_ok else ())
        second = second_run_outcome(result)
    runner.crash_reruns.append(CrashRerun(case.case_id, hook, *first_loss(first), report.rank_problems(first),
                                          second))
    return run
