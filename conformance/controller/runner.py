"""The controller's side of a case: pick the pool, run, turn rank outcomes into one verdict.

:class:`Runner` is what the suite's tests call. It keeps one
:class:`~conformance.controller.pools.Pool` per world size for the whole session (local
ranks, :class:`~conformance.controller.local_pool.RankPool`, or torchrun's,
:class:`~conformance.controller.remote.RemotePool`) and
raises :class:`ConformanceFailure` (an ``AssertionError``, so pytest reports a
plain failure) with a message that names the hook, check, strategy, model,
world size, and per finding the rank, step and parameter FQN, and ends with
the command that re-runs just that case.

[How a case travels]
1. Collection (controller). The plugin's ``pytest_generate_tests`` asks the
   hook API that owns each suite test (``apis.planned_cases``, the adapter's
   case plan) for its cases over the loaded specs (``spec_loading.load_specs``)
   and the settings; a case that cannot run here is a skip with its reason,
   and the known-failures book marks expected failures.
2. Pools (controller). The plugin orders the cases by hook. Every spec is
   first loaded once in a throwaway rank of its own (a failure there ends the
   session with exit 4, before any case). Then the pools of each hook's
   world sizes, placed by ``Settings.placement`` (backend and device), start
   together for that hook's cases and are closed before the next hook's:
   ranks forked from the zygote (which never runs hook code) for one hook, so
   no code of one hook (its import, its state factory, its calls) ever runs
   in a process that later checks another. Each rank
   (``python -m conformance.worker``) takes the controller's ``sys.path``,
   fingerprints its clean process state, loads the hook's spec, then joins
   its process group.
3. Dispatch (controller). A test calls :meth:`Runner.run_case`, which plans the case by its suite test's
   kind (:class:`~conformance.controller.case_kinds.CaseKinds`, a :class:`~conformance.controller.case_kinds.CasePlan`)
   and runs the plan through :meth:`Runner.run`, which wraps the
   case as a picklable :class:`~conformance.protocol.Case` (check name, a
   ``HookRef`` to re-load the spec, parameters) and sends it to every rank.
4. The check (every rank). The worker looks the check up in
   ``conformance.ranks.checks`` (named by the API's ``HookApi``) and runs it
   with a ``RankContext``; the check announces its phases (shown if it hangs),
   agrees with the other ranks before it stops early (``any_rank``), and
   returns findings (a ``CheckResult``).
5. Outcomes (controller). Each rank answers with a ``RankOutcome``; a rank
   that raises, hangs past ``--case-timeout`` (stacks via faulthandler) or
   dies is reported per rank, and the pool is rebuilt when the ranks no
   longer match up in any process group they hold. Who is to blame is one pure function of the case's
   runs (:func:`conformance.controller.attribution.attribute`): it reads the first run and asks for a
   replay where it needs one (the case again in fresh ranks after a rank's death by a signal, the
   reference alone, PyTorch's own default hook in the hook's place); the runner runs it
   (:mod:`conformance.controller.replays`) and asks again, until it is final: the hook's fails the case,
   PyTorch's or "not applicable" skips it, the suite's or the machine's makes it ``NOT RUN``
   (:class:`NotRun`), as a pool that cannot start does.
6. Verdict (controller). Findings become one ``ConformanceFailure`` message
   with the re-run command; the plugin's summary turns every report into the
   per-hook verdict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import pytest

from conformance.controller import failures
from conformance.controller.across_ranks import findings_of
from conformance.controller.case_kinds import CaseKinds
from conformance.controller.attribution import Attribution, Blame, Replay, Run, attribute, case_run
from conformance.controller.failures import ConformanceFailure, NotRun, pool_not_run
from conformance.controller.hard_inputs import check_case
from conformance.controller.local_pool import RankPool
from conformance.controller.pools import Pool, PoolConfig, PoolStartError, SpecLoadError
from conformance.reports.reach import note_reach
from conformance.controller.remote import remote_pool
from conformance.controller.replays import CrashRerun, case_facts, replay
from conformance.controller.zygote_client import close_zygote
from conformance.protocol import Case, CaseResult, Finding, HookRef
from conformance.reports import report
from conformance.reports.hook_code import HookCodeLedger

if TYPE_CHECKING:  # pragma: no cover
    from conformance.cases import CaseParams
    from conformance.controller.settings import Settings

__all__ = ["Runner"]


class Runner:
    """Runs cases on the session's rank pools.

    Args:
        settings: the session's :class:`~conformance.controller.settings.Settings`.
        specs: the loaded specs (:class:`~conformance.shared.spec_loading.LoadedSpec`);
            every rank loads them all when its pool starts.
        sys_path: the module search path the controller loaded them with; every
            rank gets it (:func:`~conformance.shared.spec_loading.user_paths_first`).

    Attributes:
        restarts: pools restarted after a case hung, killed a rank, or left the
            ranks out of step.
        timings: ``(wall_s, max_rank_compute_s)`` per case, for the benchmark.
        hook_pool_starts: pools started for a hook (each hook gets ranks of its own).
        not_run: ``(hook, world size) -> why`` its pool could not start; those cases are NOT RUN.
        crash_replays: the outcomes of PyTorch's default hook replayed on crashed cases, by case shape.
        crash_reruns: cases whose rank died, each run once more in fresh ranks (:class:`CrashRerun`).
    """

    def __init__(self, settings: Settings, specs: Sequence[Any], sys_path: Sequence[str] = ()):
        self.settings = settings
        self.specs = {item.spec.name: item for item in specs}
        self.sys_path = tuple(sys_path)
        self.pools: Dict[int, Pool] = {}
        self.restarts = 0
        self.timings: List[tuple] = []
        #: The world sizes each hook's cases need (the plugin fills it from the collected cases), so
        #: the pools of a hook start together when its first case comes.
        self.world_sizes_of: Dict[Optional[str], Set[int]] = {}
        #: The hook whose ranks the pools hold now.
        self.serving: Optional[str] = None
        #: Pools started for a hook (one per hook and world size, plus rebuilds after leaks).
        self.hook_pool_starts = 0
        #: ``(hook, world size) -> reason`` of pools that could not start: their cases are NOT RUN.
        self.not_run: Dict[Tuple[Optional[str], int], str] = {}
        #: ``(rank check, default hook, world size, params) ->`` PyTorch's default hook replayed on a case shape
        #: (:func:`~conformance.controller.replays.replay`). Zoo and user hooks that fail share their cases' replays.
        self.crash_replays: Dict[Tuple[Any, ...], Run] = {}
        #: Cases whose rank died by a signal, run once more in fresh ranks (:attr:`Replay.CRASH_RERUN`).
        self.crash_reruns: List[CrashRerun] = []
        #: Which of each hook's own code its cases ran, merged over every rank of every case's run.
        self.hook_code = HookCodeLedger()

    def _specs_of(self, hook: Optional[str]) -> Tuple[Tuple[str, str], ...]:
        return ((self.specs[hook].target, hook),) if hook is not None else ()

    @property
    def remote(self) -> bool:
        """Whether torchrun starts the ranks (``--listen``): they re-exec for each hook instead of forking."""
        return getattr(self.settings, "listen", None) is not None

    def pool(self, world_size: int, hook: Optional[str] = None) -> Pool:
        """The pool of ``world_size`` ranks for ``hook``'s cases, placed by :meth:`Settings.placement` (made,
        not started). Asking for another hook than the pools serve closes them all first (:meth:`serve`)."""
        s = self.settings
        if hook != self.serving:
            self.serve(hook)
        if world_size not in self.pools:
            backend, device = s.placement(world_size)
            config = PoolConfig(world_size=world_size, backend=backend, device=device,
                                case_timeout_s=s.case_timeout_s, sys_path=self.sys_path, specs=self._specs_of(hook),
                                log_limit_bytes=s.rank_log_limit_bytes,
                                memory_growth_bytes=s.rank_memory_growth_bytes)
            if self.remote:  # torchrun's ranks, on any node (conformance.controller.remote)
                self.pools[world_size] = remote_pool(config, s.listen, s.listen_timeout_s)
            else:
                self.pools[world_size] = RankPool(config)
        return self.pools[world_size]

    def serve(self, hook: Optional[str]) -> None:
        """Give the pools to ``hook``: close every pool whose ranks loaded another hook (they ran its code),
        and launch, together, the pools of the world sizes ``hook``'s cases need (their start-ups overlap;
        a pool that fails to launch is retried, and reported, by its first case)."""
        self.serving = hook
        specs = self._specs_of(hook)
        for pool in self.pools.values():
            pool.serve(specs)
        for ws in sorted(self.world_sizes_of.get(hook, ())):
            if (hook, ws) in self.not_run:
                continue
            pool = self.pool(ws, hook)
            if not pool.alive:
                self.hook_pool_starts += 1
                try:
                    pool.launch()
                except PoolStartError:
                    pass
        for pool in self.pools.values():  # the last hook's ranks exited while these started
            pool.reap()

    def check_specs(self) -> None:
        """Load every spec once in a throwaway rank of its own (one per ``--hook`` target, all at once),
        before any case: a spec that loads on the controller but not inside a rank ends the session as a
        usage error (exit 4), whichever hook's turn it would have been. Those ranks run no case."""
        targets: Dict[str, List[str]] = {}
        for name, item in self.specs.items():
            targets.setdefault(item.target, []).append(name)
        loaders: List[Pool] = []
        try:
            for target, names in targets.items():
                loader = RankPool(PoolConfig(world_size=1, backend="gloo", device="cpu",
                                             sys_path=self.sys_path, specs=tuple((target, n) for n in names)))
                loader.launch()
                loaders.append(loader)
            for loader in loaders:
                try:
                    loader.wait_ready()
                except SpecLoadError as exc:
                    self.usage_error(exc)
                except PoolStartError:
                    pass  # the hook's own pool will report it, as the run's failure
        finally:
            for loader in loaders:
                loader.close()

    def prestart(self, hook: Optional[str]) -> None:
        """Launch the pools of the first hook's cases, so their start-ups overlap with each other and with
        the rest of collection. An interruption kills every pool."""
        try:
            self.serve(hook)
        except BaseException:
            for pool in self.pools.values():
                pool.kill()
            raise

    def usage_error(self, exc: SpecLoadError) -> None:
        """End the session with exit code 4: a hook spec that loads on the controller fails inside a rank."""
        self.close()
        pytest.exit(f"usage error: a hook spec cannot be loaded inside the rank processes, so no case can run "
                    f"(no hook is blamed): {exc}\nThe ranks import specs with the controller's sys.path "
                    "(working directory, then PYTHONPATH); make the module importable there.",
                    returncode=pytest.ExitCode.USAGE_ERROR)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        close_zygote()

    def run(self, test_name: str, *, check: str, hook: Optional[str], params: Dict[str, Any], world_size: int,
            describe: Dict[str, Any], known_failure: bool = False, nodes: int = 1, claims_exactness: bool = False,
            judge: Optional[Callable[[CaseResult], List[Finding]]] = None,
            finished: Optional[Callable[[CaseResult], None]] = None,
            note: Optional[Callable[[CaseResult, List[Finding]], str]] = None, reproduce: bool = True) -> CaseResult:
        """Run one case on every rank of the ``world_size`` pool, and end it as its attribution says.

        Args:
            test_name: the pytest test name (``item.name``), for messages and the re-run command.
            check: the rank check's registered name.
            hook: the spec's name, or ``None``.
            params: keyword arguments for the rank check.
            describe: what the case is (check, strategy, model, ...), shown on failure.
            known_failure: the case is an expected failure (xfail): nothing is re-run or replayed, there being
                no red to avoid.
            nodes: the node layout the case simulates (:attr:`~conformance.protocol.Case.nodes`).
            claims_exactness: an exactness check of a hook with no lossy contract (the attribution's fact).
            judge: a run's findings, where every rank finished (default: every rank's findings, then what the
                hook left in its ranks, :meth:`CaseResult.leak_findings`).
            finished: called with the case's result where every rank finished, before it is judged.
            note: ``note(result, findings)`` closes the failure text of findings the hook may be blamed for
                (it runs on success too, with none).
            reproduce: write the failure's standalone reproducer (under ``--write-reproducers``); ``False`` for a
                run whose failure is only a step of a search (hypothesis's shrinking, which runs one at the end).

        The first run and each replay the attribution asks for
        (:func:`~conformance.controller.attribution.attribute`) are its :class:`Run` values; the runner runs
        nothing else. A re-run in fresh ranks after a death by a signal is the case's run (once per hook:
        :attr:`crash_reruns` keeps the first run).

        Raises:
            ConformanceFailure: the hook is to blame: a rank raised, hung or died, or it has findings.
            NotRun: the pool could not start, or the suite or the machine is to blame.
            pytest.skip.Exception: PyTorch is to blame, or the hook was never called.
        """
        __tracebackhide__ = True
        ref = HookRef(target=self.specs[hook].target, name=hook) if hook is not None else None
        case = Case(check=check, hook=ref, params=params, case_id=test_name, nodes=nodes, diagnose=not known_failure,
                    hook_code=getattr(self.settings, "hook_coverage", True))
        if judge is None:
            judge = lambda r: [f for o in r.outcomes for f in o.value.findings] + r.leak_findings()  # noqa: E731
        pool = self._pool_or_not_run(world_size, hook)
        first = self.run_on(pool, case)
        if hook is not None:
            self.hook_code.add(hook, first.outcomes, self.settings.placement(world_size)[0])
        runs = [Run(Replay.NONE, first, tuple(judge(first)) if first.all_ok else ())]
        if first.all_ok and not runs[0].findings:  # the common case: nothing to attribute
            if finished is not None:
                finished(first)
            if note is not None:
                note(first, [])
            return first
        facts = case_facts(self, case, world_size, describe, known_failure, claims_exactness)
        attribution = attribute(facts, runs)
        while not attribution.final:  # run what it asks for, and ask again
            runs.append(replay(self, attribution.next, case, world_size, pool, judge, first))
            attribution = attribute(facts, runs)
        return self._end(attribution, runs, case, world_size, describe, known_failure, finished, note,
                         reproduce=reproduce)

    def _end(self, attribution: Attribution, runs: List[Run], case: Case, world_size: int,
             describe: Dict[str, Any], known_failure: bool, finished: Optional[Callable[[CaseResult], None]],
             note: Optional[Callable[[CaseResult, List[Finding]], str]], reproduce: bool = True) -> CaseResult:
        """Act on the final ``attribution``: fail, skip, ``NOT RUN`` or pass the case."""
        __tracebackhide__ = True
        run = case_run(runs)
        result, found, hook = run.result, list(run.findings), case.hook.name if case.hook is not None else None
        assert result is not None
        blame, reason = attribution.blame, attribution.reason
        problems = failures.rank_problems(result, runs, self.crash_reruns)
        if not problems and finished is not None:
            finished(result)
        if blame in (Blame.SUITE, Blame.MACHINE):
            raise NotRun(reason, detail=attribution.detail or problems)
        closing = []
        if not problems and note is not None and attribution.closes_with_the_checks_note:
            closing.append(note(result, found))
        if blame in (Blame.PYTORCH, Blame.NOT_APPLICABLE):
            pytest.skip(reason)
        if blame is Blame.NOBODY:
            return result
        closing.append(reason)
        if attribution.reproduced and not known_failure and reproduce:
            closing.append(failures.reproducer_note(self.settings, self.specs.get(hook) if hook else None,
                                                        case, world_size, found, describe))
        text = "\n".join(t for t in closing if t)
        header = report.header(hook, describe, world_size)
        if problems:
            self.fail(case.case_id, hook, header, problems + (f"\n{text}" if text else ""), world_size,
                      result.leak_findings(), rank_problems=True)
        self.fail_findings(case.case_id, hook, describe, world_size, found, note=text)
        return result

    def run_on(self, pool: Pool, case: Case, *, own: bool = True) -> CaseResult:
        """``pool.run(case)``: every run of a case passes here, its first, a replay (another hook, or the reference
        alone) and a re-run in fresh ranks. A rebuilt pool counts in :attr:`restarts`.

        ``own``: the case's own run (its first, or its re-run), timed in :attr:`timings`; where its pool cannot
        start, the case is :class:`NotRun` (and every later case of that hook and world size, at once), and a spec
        that cannot load ends the session (:meth:`usage_error`). A replay (``own=False``) lets
        :class:`PoolStartError` through (:func:`~conformance.controller.replays.replay` says it could not start,
        with no evidence either way), and :class:`SpecLoadError` too (the replay's spec is not the user's).
        """
        __tracebackhide__ = True
        hook = case.hook.name if case.hook is not None else None
        try:
            result = pool.run(case)
        except SpecLoadError as exc:
            if not own:
                raise  # the replay's own spec (PyTorch's default hook): the suite's failure, not the user's
            self.usage_error(exc)
        except PoolStartError as exc:
            if not own:
                raise
            self.not_run[(hook, pool.config.world_size)] = str(exc)
            raise self._not_run(hook, pool.config.world_size) from None
        if result.pool_rebuilt:
            self.restarts += 1
        if own:
            self.timings.append((result.wall_s, result.max_compute_s))
        return result

    def _pool_or_not_run(self, world_size: int, hook: Optional[str]) -> Pool:
        """The case's pool; :class:`NotRun` at once where that hook's pool at that world size already failed
        to start (another wait would only fail again)."""
        __tracebackhide__ = True
        if (hook, world_size) in self.not_run:
            raise self._not_run(hook, world_size)
        return self.pool(world_size, hook)

    def _not_run(self, hook: Optional[str], world_size: int) -> NotRun:
        return pool_not_run(self.not_run[(hook, world_size)], world_size)

    @staticmethod
    def tag(request: pytest.FixtureRequest, case: CaseParams, check: str) -> Dict[str, Any]:
        """Give the test its case's JUnit properties (:meth:`CaseParams.junit_properties`, which the
        per-hook summary reads); return ``case.describe(check)`` for failure headers."""
        request.node.user_properties.extend(case.junit_properties(check))
        return case.describe(check)

    def run_case(self, request: pytest.FixtureRequest, case: CaseParams) -> None:
        """Run one suite case end to end: what every suite test function calls.

        Plans it by its suite test's kind (:class:`~conformance.controller.case_kinds.CaseKinds`: a
        :class:`~conformance.controller.case_kinds.CasePlan`), gives the test its case's JUnit properties
        (:meth:`tag`), then runs the plan's rank check with its parameters on every rank of the case's pool
        (:meth:`run`; a hard-input case through :func:`~conformance.controller.hard_inputs.check_case`), and fails
        the case with every rank's findings. With ``plan.across_ranks``, a case without findings compares each
        rank's per-step gradients (``CheckResult.grads``) with rank 0's
        (:func:`~conformance.controller.across_ranks.findings_of`). ``plan.note(result, findings)`` closes the
        failure text (it runs on success too, with no findings, and may add JUnit properties of figures).
        ``plan.exact``: an exactness check, whose failure, for a hook that declares no lossy contract, may be a
        lossy design not declared (:attr:`~conformance.controller.attribution.CaseFacts.claims_exactness`).

        Raises:
            ConformanceFailure: a rank raised, hung or died, or there are findings.
            NotRun: the case could not run here, or the suite or the machine is to blame.
            pytest.skip.Exception: PyTorch is to blame, the hook was never called, or a combined case is not
                needed.
            KeyError: the case's API or check names no suite test.
        """
        __tracebackhide__ = True
        plan = CaseKinds(self, request).plan(case)
        if plan.hard_inputs:
            check_case(self, request, case, plan.check, plan.rank_check, plan.params)
            return
        describe = self.tag(request, case, plan.check)
        exact = plan.exact and case.hook is not None and self.specs[case.hook].spec.lossy is None
        self.run(request.node.name, check=plan.rank_check, hook=case.hook, world_size=case.world_size,
                 params=plan.params, describe=describe, nodes=case.nodes,
                 known_failure=request.node.get_closest_marker("xfail") is not None, claims_exactness=exact,
                 judge=lambda result: findings_of(result, plan.across_ranks),
                 finished=lambda result: note_reach(request, result, real_nodes=getattr(
                     self.pools.get(case.world_size), "nodes", None)), note=plan.note)

    def fail(self, test_name: str, hook: Optional[str], header: str, body: str,
             world_size: Optional[int] = None, findings: Sequence[Finding] = (), rank_problems: bool = False) -> None:
        """Raise the case's :class:`ConformanceFailure`: ``header``, ``body``, then the re-run command."""
        __tracebackhide__ = True
        rerun = self.rerun_command(test_name, hook, world_size)
        raise ConformanceFailure(report.failure_message(header, body, rerun), findings, rank_problems)

    def rerun_command(self, test_name: str, hook: Optional[str], world_size: Optional[int] = None) -> str:
        """The shell command that re-runs just ``test_name`` from a fresh shell here
        (:func:`~conformance.controller.failures.rerun_command`)."""
        return failures.rerun_command(self.settings, self.specs.get(hook) if hook else None, test_name,
                                          world_size)

    def fail_findings(self, test_name: str, hook: Optional[str], describe: Dict[str, Any], world_size: int,
                      findings: Sequence[Finding], note: str = "") -> None:
        """Fail the case with ``findings`` (and a closing ``note``), if there are any; else return."""
        __tracebackhide__ = True
        if findings:
            body = report.findings_text(findings) + (f"\n{note}" if note else "")
            self.fail(test_name, hook, report.header(hook, describe, world_size), body, world_size, findings)
