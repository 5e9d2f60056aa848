"""The controller's side of a case: pick the pool, run, turn rank outcomes into one verdict.

:class:`Runner` is what the suite's tests call. It keeps one
:class:`~conformance.controller.pools.Pool` per world size for the whole session (local
ranks, :class:`~conformance.controller.pool.RankPool`, or torchrun's,
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
3. Dispatch (controller). A test calls :meth:`Runner.run_case`, which runs its API's suite test
   (``controller/case_kinds.py``) through :meth:`Runner.check` (:meth:`Runner.run`), which wraps the
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
   longer match up in any process group they hold. A case in which a rank
   died runs once more (once per hook), in the fresh ranks that the rebuilt
   pool starts: the second run is the case's (a death can come from before
   the case); the hook's verdict line and the summary say so. What the hook
   left changed in its ranks' process state, a process group that no longer
   runs a collective in step, and memory grown past the bound over the
   hook's cases fail the case, and the pool is rebuilt. A
   failure inside the suite's own reference is replayed with the reference
   alone, and becomes a skip if that fails too. Findings that name no cause
   of the hook's own are replayed with PyTorch's own default hook for the
   case (in fresh ranks), and become a skip if it shows the same difference,
   or if a reference caveat of this torch version explains them
   (:mod:`conformance.controller.default_replay`). A rank that raised, hung or died
   while the hook's model trained is replayed with that default hook too; where it
   fails the same way, no hook could pass the case here (:func:`replay_crash`). That,
   and a pool that cannot start, is the run's failure, not the hook's: the case is
   ``NOT RUN`` (:class:`NotRun`).
6. Verdict (controller). Findings become one ``ConformanceFailure`` message
   with the re-run command; the plugin's summary turns every report into the
   per-hook verdict.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import pytest

from conformance.controller import case_kinds, default_replay
from conformance.controller.across_ranks import compare_across_ranks, findings_of
from conformance.controller.cli import command_words, python_words
from conformance.controller.failures import ConformanceFailure, NotRun, pool_not_run
from conformance.controller.pool import RankPool
from conformance.controller.pools import Pool, PoolConfig, PoolStartError, SpecLoadError
from conformance.controller.reach import note_reach
from conformance.controller.remote import remote_pool
from conformance.controller.replays import (RERUN_NOT_STARTED, CrashRerun, first_loss, lost_a_rank, replay_crash,
                                           replay_default_hook, replay_reference, second_run_outcome)
from conformance.shared.spec_loading import pythonpath_to_rerun
from conformance.controller.zygote_client import close_zygote
from conformance.protocol import Case, CaseResult, Finding, HookRef
from conformance.controller.replay_policy import REPLAYS_DEFAULT_HOOK, REPLAYS_REFERENCE
from conformance.reports import report
from conformance.reproducers import writer

# ConformanceFailure, NotRun and compare_across_ranks are imported from here too (their home before the split).
__all__ = ["ConformanceFailure", "NotRun", "Runner", "compare_across_ranks"]



def not_the_hooks(found: Sequence[Finding]) -> None:
    """End a case whose every finding says the hook is not what failed: the API never called the hook there
    (kind ``"not_applicable"``: a skip, with the first as the reason), or a rule that holds whatever the hook
    is broke: PyTorch's (kind ``"pytorch_changed"``: a skip with the findings as the reason, as for a reference
    that does not hold on this torch) or one the suite's other checks rely on (kind ``"suite"``: its own
    registration, or a reference that may no longer be native; with or without PyTorch's: :class:`NotRun`, the
    run's failure). Returns where any finding could be the hook's, or there are none."""
    __tracebackhide__ = True
    if found and all(f.kind == "not_applicable" for f in found):
        pytest.skip(f"ran, and matched, but the hook was never called: {found[0].message}")
    if not found or any(f.kind not in ("pytorch_changed", "suite") for f in found):
        return
    said = list(dict.fromkeys(f.message for f in found))  # every rank says the same: once each
    if any(f.kind == "suite" for f in found):
        first = next(f.message for f in found if f.kind == "suite")
        raise NotRun(f"a rule that holds whatever the hook is, and that the suite's other checks rely on, fails "
                     f"here: {first}", detail="\n".join(m for m in said if m != first))
    pytest.skip(" ".join(said))


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

    def __init__(self, settings: Any, specs: Sequence[Any], sys_path: Sequence[str] = ()):
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
        #: ``(rank check, default hook, world size, params) ->`` how PyTorch's default hook, replayed on a case
        #: where a hook's rank raised, hung or died, failed it (:func:`~conformance.controller.replays.replay_crash`;
        #: empty: it ran to the end). Zoo and user hooks that crash share their cases' replays.
        self.crash_replays: Dict[Tuple[Any, ...], FrozenSet[Tuple[str, ...]]] = {}
        #: Cases whose rank died, run once more in fresh ranks (:func:`~conformance.controller.replays.lost_a_rank`).
        self.crash_reruns: List[CrashRerun] = []

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
            describe: Dict[str, Any], findings: bool = True, known_failure: bool = False,
            nodes: int = 1) -> CaseResult:
        """Run one case on every rank of the ``world_size`` pool.

        Args:
            test_name: the pytest test name (``item.name``), for messages and the re-run command.
            check: the rank check's registered name.
            hook: the spec's name, or ``None``.
            params: keyword arguments for the rank check.
            describe: what the case is (check, strategy, model, ...), shown on failure.
            findings: treat each rank's return value as a list of findings.
            known_failure: the case is an expected failure (xfail): a crash is not re-run or replayed
                (:func:`~conformance.controller.replays.replay_crash`), there being no red to avoid.
            nodes: the node layout the case simulates (:attr:`~conformance.protocol.Case.nodes`).

        A rank that died (:func:`~conformance.controller.replays.lost_a_rank`) runs the case once more in
        fresh ranks; that run is the case's (:attr:`crash_reruns` keeps the first). Once per hook: a second
        death in the same hook's cases is no passing accident of the machine (a hook that crashes after
        so many calls would pass each re-run), and its failure stands.

        Raises:
            ConformanceFailure: a rank raised, hung or died, or returned findings.
            NotRun: the pool could not start, or PyTorch's own default hook fails the case the same way
                (:func:`~conformance.controller.replays.replay_crash`).
        """
        __tracebackhide__ = True
        ref = None
        if hook is not None:
            ref = HookRef(target=self.specs[hook].target, name=hook)
        case = Case(check=check, hook=ref, params=params, case_id=test_name, nodes=nodes, diagnose=not known_failure)
        pool = self._pool_or_not_run(world_size, hook)
        result = self._run_on(pool, case, hook, world_size)
        rerun_note = ""
        if lost_a_rank(result) and not known_failure and not any(r.hook == hook for r in self.crash_reruns):
            first = result
            try:
                result = self._run_on(pool, case, hook, world_size)  # the pool was rebuilt: ranks of this case alone
            except NotRun:  # no fresh ranks (torchrun's restarts spent, say): no evidence, the first run stands
                result, second = first, RERUN_NOT_STARTED
                why = (self.not_run.get((hook, world_size)) or "").strip().splitlines()
                rerun_note = (f"\n(a rank died, and the case could not run again in fresh ranks"
                              f"{': ' + why[0] if why else ''})")
            else:
                second = second_run_outcome(result)
            rerun = CrashRerun(test_name, hook, *first_loss(first), report.rank_problems(first), second)
            self.crash_reruns.append(rerun)
            if second != RERUN_NOT_STARTED:
                rerun_note = (f"\n(the case was run twice, the second time in fresh ranks of its own; this is the "
                              f"second run's failure; the first: {rerun.death})")
        problems = report.rank_problems(result)
        problems += rerun_note if problems else ""
        leaks = result.leak_findings()
        if problems:
            if leaks:
                problems += "\n" + report.findings_text(leaks)
            if report.failed_in_reference(result) and check in REPLAYS_REFERENCE:
                problems += replay_reference(self, pool, case, describe)
            elif ref is not None and not leaks and not known_failure:
                problems += replay_crash(self, case, world_size, params, result, problems)
                note = self.reproducer_note(test_name, hook, check, params, world_size, [], describe)
                problems += f"\n{note}" if note else ""
            self.fail(test_name, hook, report.header(hook, describe, world_size), problems, world_size, leaks,
                      rank_problems=True)
        if findings:
            found = [f for o in result.outcomes for f in o.value.findings] + leaks
            # A case that passed gets no reproducer: there is nothing to reproduce (a hard-input case also
            # passes here for each example its search and shrink try).
            note = "" if known_failure or not found else self.reproducer_note(test_name, hook, check, params,
                                                                              world_size, found, describe)
            self.fail_findings(test_name, hook, describe, world_size, found, note=note)
        return result

    def _run_on(self, pool: Pool, case: Case, hook: Optional[str], world_size: int) -> CaseResult:
        """``pool.run(case)``, counted; a pool that cannot start makes the case :class:`NotRun`, a spec that
        cannot load ends the session (:meth:`usage_error`)."""
        __tracebackhide__ = True
        try:
            result = self.run_replay(pool, case)
        except SpecLoadError as exc:
            self.usage_error(exc)
        except PoolStartError as exc:
            self.not_run[(hook, world_size)] = str(exc)
            raise self._not_run(hook, world_size) from None
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
    def tag(request: Any, case: Any, check: str) -> Dict[str, Any]:
        """Give the test its case's JUnit properties (:meth:`CaseParams.junit_properties`, which the
        per-hook summary reads); return ``case.describe(check)`` for failure headers."""
        request.node.user_properties.extend(case.junit_properties(check))
        return case.describe(check)

    def check(self, request: Any, case: Any, check: str, rank_check: str, params: Dict[str, Any], *,
              across_ranks: bool = False, note: Optional[Callable[[CaseResult, List[Finding]], str]] = None
              ) -> CaseResult:
        """Run one suite case end to end: what every suite test function calls.

        Gives the test its case's JUnit properties (``case.junit_properties(check)``),
        runs ``rank_check`` with ``params`` on every rank of the case's pool
        (:meth:`run`), and fails the case with every rank's findings. With
        ``across_ranks``, a case without findings compares each rank's per-step
        gradients (``CheckResult.grads``) with rank 0's (:func:`compare_across_ranks`).
        ``note(result, findings)`` closes the failure text (it runs on success
        too, with no findings, and may add JUnit properties of figures).

        Raises:
            ConformanceFailure: a rank raised, hung or died, or there are findings.
        """
        __tracebackhide__ = True
        describe = self.tag(request, case, check)
        name = request.node.name
        known_failure = request.node.get_closest_marker("xfail") is not None
        result = self.run(name, check=rank_check, hook=case.hook, world_size=case.world_size, params=params,
                          describe=describe, findings=False, known_failure=known_failure, nodes=case.nodes)
        note_reach(request, result, real_nodes=getattr(self.pools.get(case.world_size), "nodes", None))
        found = findings_of(result, across_ranks)
        not_the_hooks(found)
        closing = note(result, found) if note is not None else ""
        if (rank_check in REPLAYS_DEFAULT_HOOK and default_replay.could_be_pytorchs(found)
                and not known_failure):  # a known failure is no red to avoid
            replayed = replay_default_hook(self, case, rank_check, params, found, across_ranks)
            closing = "\n".join(text for text in (closing, replayed) if text)
        if found and not known_failure:
            reproducer = self.reproducer_note(name, case.hook, rank_check, params, case.world_size, found, describe)
            closing = "\n".join(text for text in (closing, reproducer) if text)
        self.fail_findings(name, case.hook, describe, case.world_size, found, note=closing)
        return result

    def run_case(self, request: Any, case: Any) -> None:
        """Run one suite case as its API's suite test says (:func:`conformance.controller.case_kinds.run_case`):
        what every suite test function calls."""
        __tracebackhide__ = True
        case_kinds.run_case(self, request, case)

    def run_replay(self, pool: Pool, replay: Case) -> CaseResult:
        """Run a replay of a failed case (another hook, or the reference alone) on ``pool``, counting a rebuilt
        pool in :attr:`restarts` (every case runs through here, :meth:`_run_on` too)."""
        result = pool.run(replay)
        if result.pool_rebuilt:
            self.restarts += 1
        return result

    def reproducer_note(self, test_name: str, hook: Optional[str], rank_check: str, params: Dict[str, Any],
                        world_size: int, findings: Sequence[Finding], describe: Dict[str, Any]) -> str:
        """Under ``--write-reproducers DIR``, write the failed case's standalone reproducer
        (:mod:`conformance.reproducers`) and return the failure's lines that say where it is and how to run it
        (:meth:`reproducer_command`, and why it needs the suite where it does), or why the case has none; ``""``
        without the option (or for a case of no hook). Only a failed case is given one: callers pass its
        findings (none for a rank that raised, hung or died)."""
        directory = getattr(self.settings, "reproducers_dir", None)
        item = self.specs.get(hook) if hook else None
        if not directory or item is None:
            return ""
        path = writer.reproducer_path(directory, test_name)
        try:
            source = writer.reproducer_source(item.spec, item.target, rank_check, params, world_size, test_name,
                                              findings, report.header(hook, describe, world_size),
                                              self.rerun_command(test_name, hook, world_size), path,
                                              nodes=int(describe.get("nodes", 1)))
            writer.write_reproducer(path, source)
        except writer.NoReproducer as exc:
            return f"No standalone reproducer: {exc}"
        except OSError as exc:
            return f"No standalone reproducer: writing {path} failed: {exc}"
        needs = writer.needs_the_suite(item.spec, item.target)
        return (f"Standalone reproducer: {path}\n"
                f"  {self.reproducer_command(path)}   (from this directory; it starts its {world_size} ranks; "
                f"exit 1 reproduced, 0 not, 2 could not run)"
                + (f"\n  It needs commhook-conformance installed: {needs}" if needs else ""))

    @staticmethod
    def reproducer_command(path: str) -> str:
        """The shell command that runs a reproducer from a fresh shell in this working directory: ``PYTHONPATH=...``
        first where the session imported modules from ``PYTHONPATH`` entries (as :meth:`rerun_command`), then this
        interpreter (``python`` where the ``python`` on ``PATH`` is this venv's, :func:`python_words`) and the file."""
        command = " ".join(shlex.quote(w) for w in [*python_words(), path])
        extra = pythonpath_to_rerun()
        return f"PYTHONPATH={shlex.quote(os.pathsep.join(extra))} {command}" if extra else command

    def fail(self, test_name: str, hook: Optional[str], header: str, body: str,
             world_size: Optional[int] = None, findings: Sequence[Finding] = (), rank_problems: bool = False) -> None:
        """Raise the case's :class:`ConformanceFailure`: ``header``, ``body``, then the re-run command."""
        __tracebackhide__ = True
        rerun = self.rerun_command(test_name, hook, world_size)
        raise ConformanceFailure(report.failure_message(header, body, rerun), findings, rank_problems)

    def rerun_command(self, test_name: str, hook: Optional[str], world_size: Optional[int] = None) -> str:
        """The shell command that re-runs just ``test_name`` from a fresh shell in this working directory.

        ``PYTHONPATH=...`` first where the session imported modules from
        ``PYTHONPATH`` entries other than the working directory (a hook package
        outside it, :func:`~conformance.shared.spec_loading.pythonpath_to_rerun`); then
        ``conform``, or ``/path/to/python -m conformance`` where the ``conform`` on
        ``PATH`` is not this interpreter's (:func:`~conformance.controller.cli.command_words`:
        a fresh shell may not have the venv on ``PATH``); then the hook's ``--hook``
        target (a built-in or entry-point hook needs none), the machine settings of
        the case's pool and a hypothesis seed where one was given
        (:meth:`Settings.rerun_args`, paths absolute), ``-k test_name``.
        """
        args = command_words()
        item = self.specs.get(hook) if hook else None
        if item is not None and item.origin == "--hook":
            args += ["--hook", item.target]
        args += self.settings.rerun_args(world_size)
        args += ["-k", test_name]
        command = " ".join(shlex.quote(a) for a in args)
        path = pythonpath_to_rerun()
        if path:
            # Quote the value only: a quoted "NAME=value" word is a command, not an assignment.
            command = f"PYTHONPATH={shlex.quote(os.pathsep.join(path))} {command}"
        return command

    def fail_findings(self, test_name: str, hook: Optional[str], describe: Dict[str, Any], world_size: int,
                      findings: Sequence[Finding], note: str = "") -> None:
        """Fail the case with ``findings`` (and a closing ``note``), if there are any; else return."""
        __tracebackhide__ = True
        if findings:
            body = report.findings_text(findings) + (f"\n{note}" if note else "")
            self.fail(test_name, hook, report.header(hook, describe, world_size), body, world_size, findings)
