"""The controller's side of a case: pick the pool, run, turn rank outcomes into one verdict.

:class:`Runner` is what the suite's tests call. It keeps one
:class:`~conformance.pool.RankPool` per world size for the whole session and
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
2. Pools (controller). The ``conform`` fixture makes one :class:`RankPool` per
   world size the collected cases need, placed by ``Settings.placement``
   (backend and device), and starts them together. Each rank
   (``python -m conformance.worker``) takes the controller's ``sys.path``,
   loads every spec (a failure there ends the session with exit 4), then joins
   its process group.
3. Dispatch (controller). A test calls :meth:`Runner.check` (:meth:`Runner.run`), which wraps the
   case as a picklable :class:`~conformance.protocol.Case` (check name, a
   ``HookRef`` to re-load the spec, parameters) and sends it to every rank.
4. The check (every rank). The worker looks the check up in
   ``conformance.checks`` (registered by the API's adapter module) and runs it
   with a ``RankContext``; the check announces its phases (shown if it hangs),
   agrees with the other ranks before it stops early (``any_rank``), and
   returns findings (a ``CheckResult``).
5. Outcomes (controller). Each rank answers with a ``RankOutcome``; a rank
   that raises, hangs past ``--case-timeout`` (stacks via faulthandler) or
   dies is reported per rank, and the pool is rebuilt when the ranks no
   longer match up. A failure inside the suite's own reference is replayed
   with the reference alone, and becomes a skip if that fails too. Findings
   that name no cause of the hook's own are replayed with PyTorch's own
   default hook for the case, and become a skip if it shows the same
   difference, or if a reference caveat of this torch version explains them
   (:mod:`conformance.default_replay`).
6. Verdict (controller). Findings become one ``ConformanceFailure`` message
   with the re-run command; the plugin's summary turns every report into the
   per-hook verdict.
"""

from __future__ import annotations

import os
import shlex
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import pytest
from conformance import default_replay, report
from conformance.checks import REPLAYS_DEFAULT_HOOK, REPLAYS_REFERENCE
from conformance.compare import compare_bitwise
from conformance.pool import PoolConfig, PoolStartError, RankPool, SpecLoadError, close_zygote
from conformance.protocol import Case, CaseResult, Finding, HookRef
from conformance.spec_loading import pythonpath_to_rerun



class ConformanceFailure(AssertionError):
    """A hook failed a check; the message is the whole report of that case.

    Attributes:
        findings: the findings behind it; empty when a rank raised, hung or died.
    """

    def __init__(self, message: str, findings: Sequence[Finding] = ()):
        super().__init__(message)
        self.findings = tuple(findings)


class Runner:
    """Runs cases on the session's rank pools.

    Args:
        settings: the session's :class:`~conformance.settings.Settings`.
        specs: the loaded specs (:class:`~conformance.spec_loading.LoadedSpec`);
            every rank loads them all when its pool starts.
        sys_path: the module search path the controller loaded them with; every
            rank gets it (:func:`~conformance.spec_loading.user_paths_first`).

    Attributes:
        restarts: pools restarted after a case hung, killed a rank, or left the
            ranks out of step.
        timings: ``(wall_s, max_rank_compute_s)`` per case, for the benchmark.
        memory_restarts: one line per case after which a pool was restarted because a
            rank's resident memory grew beyond ``--rank-memory-growth``, naming the case.
    """

    def __init__(self, settings: Any, specs: Sequence[Any], sys_path: Sequence[str] = ()):
        self.settings = settings
        self.specs = {item.spec.name: item for item in specs}
        self.sys_path = tuple(sys_path)
        self.pools: Dict[int, RankPool] = {}
        self.restarts = 0
        self.timings: List[tuple] = []
        self.memory_restarts: List[str] = []

    def pool(self, world_size: int) -> RankPool:
        """The pool of ``world_size`` ranks, placed by :meth:`Settings.placement` (made, not started)."""
        s = self.settings
        if world_size not in self.pools:
            backend, device = s.placement(world_size)
            specs = tuple((item.target, name) for name, item in self.specs.items())
            config = PoolConfig(world_size=world_size, backend=backend, device=device,
                                case_timeout_s=s.case_timeout_s, sys_path=self.sys_path, specs=specs,
                                log_limit_bytes=s.rank_log_limit_bytes,
                                memory_growth_bytes=s.rank_memory_growth_bytes)
            if getattr(s, "listen", None) is not None:  # torchrun's ranks, on any node (conformance.remote)
                from conformance.remote import remote_pool

                self.pools[world_size] = remote_pool(config, s.listen, s.listen_timeout_s)
            else:
                self.pools[world_size] = RankPool(config)
        return self.pools[world_size]

    def prestart(self, world_sizes: Sequence[int]) -> None:
        """Launch the pools for ``world_sizes`` at once, so their start-ups overlap.

        Start-up errors are not raised here: the first case on a pool that
        failed to start retries the start and reports the error as its failure.
        A spec that a rank cannot load ends the session as a usage error (exit
        4) before any case runs. An interruption kills every pool.
        """
        launched = []
        try:
            for ws in world_sizes:
                pool = self.pool(ws)
                if not pool.alive:
                    pool.launch()
                    launched.append(pool)
            for pool in launched:
                try:
                    pool.wait_ready()
                except SpecLoadError as exc:
                    self.usage_error(exc)
                except PoolStartError:
                    pass
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
            describe: Dict[str, Any], findings: bool = True) -> CaseResult:
        """Run one case on every rank of the ``world_size`` pool.

        Args:
            test_name: the pytest test name (``item.name``), for messages and the re-run command.
            check: the rank check's registered name.
            hook: the spec's name, or ``None``.
            params: keyword arguments for the rank check.
            describe: what the case is (check, strategy, model, ...), shown on failure.
            findings: treat each rank's return value as a list of findings.

        Raises:
            ConformanceFailure: a rank raised, hung or died, or returned findings.
        """
        __tracebackhide__ = True
        ref = None
        if hook is not None:
            ref = HookRef(target=self.specs[hook].target, name=hook)
        case = Case(check=check, hook=ref, params=params, case_id=test_name)
        pool = self.pool(world_size)
        try:
            result = pool.run(case)
        except SpecLoadError as exc:
            self.usage_error(exc)
        except PoolStartError as exc:
            raise ConformanceFailure(f"the rank pool could not start: {exc}") from None
        self.timings.append((result.wall_s, result.max_compute_s))
        if result.pool_rebuilt:
            self.restarts += 1
        if result.memory_grown:
            self._memory_grown(test_name, result)
        problems = report.rank_problems(result)
        if problems:
            if report.failed_in_reference(result) and check in REPLAYS_REFERENCE:
                problems += self._replay_reference(pool, case, describe)
            self.fail(test_name, hook, report.header(hook, describe, world_size), problems, world_size)
        if findings:
            self.fail_findings(test_name, hook, describe, world_size,
                               [f for o in result.outcomes for f in o.value.findings])
        return result

    def _memory_grown(self, test_name: str, result: CaseResult) -> None:
        """Name the case after which the pool was restarted for memory: a warning on the case, a summary line."""
        ranks = ", ".join(f"rank {r} by {grew / 2**20:.0f} MiB (to {now / 2**20:.0f} MiB)"
                          for r, grew, now in result.memory_grown)
        line = (f"{test_name}: resident memory grew during the case on {ranks}, beyond --rank-memory-growth "
                f"{self.settings.rank_memory_growth_bytes / 2**20:g} MiB; the pool was restarted after it")
        self.memory_restarts.append(line)
        warnings.warn(pytest.PytestWarning(line))

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
        result = self.run(name, check=rank_check, hook=case.hook, world_size=case.world_size, params=params,
                          describe=describe, findings=False)
        found = _findings(result, across_ranks)
        closing = note(result, found) if note is not None else ""
        if (rank_check in REPLAYS_DEFAULT_HOOK and default_replay.could_be_pytorchs(found)
                and not request.node.get_closest_marker("xfail")):  # a known failure is no red to avoid
            replayed = self._replay_default_hook(case, rank_check, params, found, across_ranks)
            closing = "\n".join(text for text in (closing, replayed) if text)
        self.fail_findings(name, case.hook, describe, case.world_size, found, note=closing)
        return result

    def _replay_default_hook(self, case: Any, rank_check: str, params: Dict[str, Any], found: List[Finding],
                             across_ranks: bool) -> str:
        """Skip a failure that any hook would get here (:mod:`conformance.default_replay`): one a reference
        caveat of this torch version explains, or that PyTorch's own default hook for the case shows too
        (replayed on the same pool, or the hook under test itself). Else the failure's closing note."""
        __tracebackhide__ = True
        import torch

        from conformance.apis import HOOK_APIS

        version, item = torch.__version__, self.specs[case.hook]
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
        result = self._replay(self.pool(case.world_size), Case(
            check=rank_check, hook=HookRef(target=api.builtin_hooks, name=name), params=params,
            case_id=f"{case.hook} case replayed with {name}"))
        theirs = _findings(result, across_ranks) if result.all_ok else []
        if result.all_ok and default_replay.same_difference(found, theirs):
            pytest.skip(default_replay.default_hook_reason(name, found, version, itself=False))
        if not default_replay.after_the_hook_returned(found):
            return ""
        return "  " + default_replay.default_hook_note(name, theirs, result.all_ok)

    def _replay_reference(self, pool: RankPool, case: Case, describe: Dict[str, Any]) -> str:
        """Train the reference alone; skip the case if it fails there too, else say the hook broke it.

        The suite never blames a hook for its own reference: a reference that
        PyTorch cannot run here (a bug of this torch version, say) makes the
        case a skip with the reference's error as the reason.
        """
        __tracebackhide__ = True
        import torch

        result = self._replay(pool, Case(check=case.check, hook=case.hook,
                                         params={**case.params, "reference_only": True}, case_id=case.case_id))
        bad = [o for o in result.outcomes if not o.ok]
        if bad:
            what = " ".join(f"{k}={v}" for k, v in describe.items())
            pytest.skip(f"the suite's reference ({what}, no hook under test) cannot run here with torch "
                        f"{torch.__version__}: rank {bad[0].rank} {bad[0].summary().split(': ', 1)[-1]}: "
                        f"{report.exception_line(bad[0].error or bad[0].stack or '')}")
        return ("\n(the reference trained alone, with no hook, runs here: the failure above comes from "
                "training it beside the hooked model)")

    def _replay(self, pool: RankPool, replay: Case) -> CaseResult:
        """Run a replay of a failed case (another hook, or the reference alone) on ``pool``."""
        result = pool.run(replay)
        if result.pool_rebuilt:
            self.restarts += 1
        return result

    def fail(self, test_name: str, hook: Optional[str], header: str, body: str,
             world_size: Optional[int] = None, findings: Sequence[Finding] = ()) -> None:
        """Raise the case's :class:`ConformanceFailure`: ``header``, ``body``, then the re-run command."""
        __tracebackhide__ = True
        rerun = self.rerun_command(test_name, hook, world_size)
        raise ConformanceFailure(report.failure_message(header, body, rerun), findings)

    def rerun_command(self, test_name: str, hook: Optional[str], world_size: Optional[int] = None) -> str:
        """The shell command that re-runs just ``test_name`` from a fresh shell in this working directory.

        ``PYTHONPATH=...`` first where the session imported modules from
        ``PYTHONPATH`` entries other than the working directory (a hook package
        outside it, :func:`~conformance.spec_loading.pythonpath_to_rerun`); then
        the hook's ``--hook`` target (a built-in or entry-point hook needs none),
        the machine settings of the case's pool and a hypothesis seed where one
        was given (:meth:`Settings.rerun_args`), ``-k test_name``.
        """
        args = ["conform"]
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


def _findings(result: CaseResult, across_ranks: bool) -> List[Finding]:
    """Every rank's findings; with ``across_ranks`` and none, each rank's gradients against rank 0's."""
    found = [f for o in result.outcomes for f in o.value.findings]
    if not found and across_ranks:
        found = compare_across_ranks([o.value.grads for o in result.outcomes])
    return found


def compare_across_ranks(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> List[Finding]:
    """Findings where a rank's gradients differ from rank 0's, step by step.

    ``per_rank[r][step][fqn]`` is rank ``r``'s gradient (CPU tensor or ``None``).
    Mirrors what DDP and FSDP ``NO_SHARD`` guarantee: after the reduction every
    rank holds the identical gradient.
    """
    findings: List[Finding] = []
    base = per_rank[0]
    for rank, steps in enumerate(per_rank[1:], start=1):
        for step, (mine, theirs) in enumerate(zip(steps, base)):
            for fqn, ref in theirs.items():
                got = mine.get(fqn)
                if (got is None) != (ref is None):
                    findings.append(Finding(rank, "gradient presence differs from rank 0", step=step, fqn=fqn))
                    continue
                if got is None:
                    continue
                mismatch = compare_bitwise(got, ref)
                if mismatch is not None:
                    findings.append(Finding(rank, "gradient differs from rank 0's after the reduction",
                                            step=step, fqn=fqn, mismatch=mismatch))
            if findings:
                return findings
    return findings
