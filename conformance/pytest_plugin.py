"""The pytest plugin: options, the hooks under test, the rank pools, known failures, the report.

Loaded by ``conform`` (``-p conformance.pytest_plugin``) and by the repository's
``conftest.py``. The test modules in ``conformance/suite/`` ask for the
``conform`` fixture (a :class:`~conformance.runner.Runner`) and run their
cases through it; everything heavy (the rank pools) starts lazily on the
first case, so loading the plugin costs little.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import pytest

from conformance import report, results_plugin
from conformance.cases import parse_case_id
from conformance.interruption import session_signals
from conformance.report_guard import PLUGIN_NAME as REPORT_FILES, ReportGuard
from conformance import settings as settings_mod
from conformance.known_failures import KnownFailureBook, KnownFailuresError, RunEnvironment, load_known_failures
from conformance.spec_loading import LoadedSpec, load_specs, user_paths_first
from conformance.spec import SpecError

#: The oldest torch the suite runs on (README's compatibility table).
MIN_TORCH = (2, 4)


@dataclasses.dataclass
class SessionState:
    settings: settings_mod.Settings
    specs: List[LoadedSpec]
    book: KnownFailureBook
    sys_path: Tuple[str, ...] = ()
    runner: Optional[object] = None
    per_hook: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    per_hook_failed_checks: Dict[str, set] = dataclasses.field(default_factory=lambda: defaultdict(set))
    xfail_reasons: Dict[str, set] = dataclasses.field(default_factory=lambda: defaultdict(set))
    xpassed: List[str] = dataclasses.field(default_factory=list)
    unused_entries: List[object] = dataclasses.field(default_factory=list)
    #: Per hook, why its cases were skipped, with counts.
    skip_reasons: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    #: World sizes at which each hook's cases ran (skipped cases excluded).
    ran_at: Dict[str, set] = dataclasses.field(default_factory=lambda: defaultdict(set))

    def spec(self, name: str) -> LoadedSpec:
        for item in self.specs:
            if item.spec.name == name:
                return item
        raise KeyError(name)


_STATE_KEY = pytest.StashKey[SessionState]()


def state_of(config: pytest.Config) -> SessionState:
    return config.stash[_STATE_KEY]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "commhook-conformance")
    for opt in settings_mod.OPTIONS:
        if opt.flag in ("--with-builtins", "--no-entry-points", "--strict-known-failures"):
            group.addoption(opt.flag, action="store_true", dest=opt.dest, default=False, help=opt.help)
        elif opt.flag in ("--hook", "--known-failures"):
            group.addoption(opt.flag, action="append", dest=opt.dest, default=[], metavar="VALUE", help=opt.help)
        else:
            group.addoption(opt.flag, action="store", dest=opt.dest, default=None, metavar="VALUE", help=opt.help)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance(api): a conformance case run on the rank pool")
    import torch

    if _release(torch.__version__) < MIN_TORCH:
        raise pytest.UsageError(f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, the "
                                "oldest the suite supports: use a venv with torch>=2.4")
    # The controller and every rank resolve modules from this one path (see user_paths_first).
    sys_path = user_paths_first()
    try:
        settings = settings_mod.resolve(config.getoption)
        specs = load_specs(settings.hooks, builtins=settings.builtins, entry_points=settings.entry_points)
        entries = []
        for path in settings.known_failures:
            entries += load_known_failures(path)
    except (settings_mod.SettingsError, SpecError, KnownFailuresError) as exc:
        raise pytest.UsageError(str(exc)) from None
    env = RunEnvironment.of_this_process(backend=settings.backend, device=settings.device)
    state = SessionState(settings=settings, specs=specs, book=KnownFailureBook(entries, env), sys_path=sys_path)
    config.stash[_STATE_KEY] = state
    config.pluginmanager.register(_Summary(state), "conformance-summary")
    config.pluginmanager.register(_Stopping(state), "conformance-stopping")
    # Before any case: an unwritable or busy report path is a usage error (the reports are marked stale later,
    # once a case is about to run).
    config.pluginmanager.register(ReportGuard(config, settings.json_path, settings.markdown_path,
                                              keep=tuple(p for p in (settings.baseline_path,) if p)), REPORT_FILES)
    results_plugin.register(config, state)  # --json, --markdown, --baseline; the per-hook grids


def _release(version: str) -> Tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is not None and state.runner is not None:
        state.runner.close()


def pytest_report_header(config: pytest.Config) -> List[str]:
    state = config.stash.get(_STATE_KEY, None)
    if state is None:
        return []
    import torch

    s = state.settings
    env = state.book.env
    sizes = " and ".join(str(w) for w in s.world_sizes)
    build = "CUDA build" if env.cuda_build else "CPU build"
    lines = [f"conformance: torch {torch.__version__} ({build}), backend {s.backend}, device {s.device}, "
             f"world sizes {sizes}, case timeout {s.case_timeout_s:g} s"]
    if s.listen is not None:
        from conformance.remote_link import format_address

        lines.append(f"  ranks: torchrun's, connecting to --listen {format_address(s.listen)} (waiting up to "
                     f"{s.listen_timeout_s:g} s): on every node, torchrun ... -m conformance.worker --controller "
                     f"{format_address(s.listen)}")
    if s.cpu_pools:
        lines.append(f"  one GPU: world size {s.world_size} alone proves nothing about averaging, so world sizes "
                     f"{' and '.join(map(str, s.cpu_pools))} run as gloo pools on the CPU")
    for item in state.specs:
        spec = item.spec
        claim = "full-precision averaging" if spec.reduce_dtype is None else f"reduce_dtype={spec.reduce_dtype_name}"
        lines.append(f"  hook {spec.name} [{spec.api}; {claim}; {', '.join(spec.strategies)}] from {item.target}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: List[pytest.Item]) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is None:
        return
    # A suite test whose API has no hook under test gets pytest's placeholder
    # parameter set ("[NOTSET]"): it is not a case, so it is deselected, not skipped.
    empty = [item for item in items if item.get_closest_marker("conformance") and item.name.endswith("[NOTSET]")]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]
    suite_items = [item for item in items if item.get_closest_marker("conformance")]
    if not suite_items:
        return
    strict = state.settings.strict_known_failures
    for item in suite_items:
        hook = _case_hook(item)
        missing = state.spec(hook).spec.missing_requirements() if hook else ()
        if missing:
            item.add_marker(pytest.mark.skip(reason=(
                f"hook {hook} needs {', '.join(missing)}, which is not installed here: "
                f"{sys.executable} -m pip install {' '.join(missing)}")))
            continue
        entry = state.book.lookup(item.name)
        if entry is not None:
            prefix = "known failure, not run" if not entry.run else "known failure"
            item.add_marker(pytest.mark.xfail(reason=f"{prefix} ({entry.source}): {entry.reason}", strict=strict,
                                              run=entry.run))
    hooks = [s.spec.name for s in state.specs]
    state.unused_entries = state.book.unused(hooks)
    for entry in state.unused_entries:
        warnings.warn(pytest.PytestWarning(
            f"known failure {entry.source} (test = {entry.test!r}, {entry.conditions()}) matches no test in this run; "
            "the failure may be fixed or the pattern out of date: update or remove the entry"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize a suite test with its API's case plan (:attr:`conformance.adapters.HookApi.plans`).

    A case that cannot run here is a skip with its reason: the world size's
    availability first (:meth:`Settings.world_size_unavailable`), then the plan's.
    """
    state = metafunc.config.stash.get(_STATE_KEY, None)
    if state is None or "case" not in metafunc.fixturenames or not metafunc.definition.get_closest_marker("conformance"):
        return
    from conformance.apis import api_of_test, planned_cases

    if api_of_test(metafunc.function.__name__) is None:
        return
    params = [pytest.param(case, id=case.id, marks=[pytest.mark.skip(reason=case.skip)] if case.skip else [])
              for case in planned_cases(metafunc.function.__name__, [item.spec for item in state.specs],
                                        state.settings)]
    metafunc.parametrize("case", params)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A :class:`~conformance.runner.ConformanceFailure` is reported as its message alone.

    The message is the whole report of the case (findings, each rank's own
    traceback, the re-run command); pytest's traceback through the suite's test
    function and the runner adds nothing a hook author can act on, whatever
    ``--tb`` says. A string ``longrepr`` is printed as it is by every ``--tb``
    style and written whole into JUnit XML (``<failure message=...>`` and its text).
    Any other exception (a bug in the suite) keeps pytest's traceback.
    """
    report = yield
    if call.excinfo is not None:
        from conformance.runner import ConformanceFailure

        if isinstance(call.excinfo.value, ConformanceFailure):
            report.longrepr = str(call.excinfo.value)
    return report


def _case_hook(item: pytest.Item) -> Optional[str]:
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    return getattr(case, "hook", None)


class _Stopping:
    """SIGTERM is handled as Ctrl-C (:class:`~conformance.interruption.StopSignals`), and an interrupted
    session kills its pools at once: their ranks are mid-case, so a polite shutdown would only wait.
    From the session's finish on, a signal is only acknowledged; handlers this session installed are
    restored last, after the pools closed (a signal while they close must not end the controller)."""

    def __init__(self, state: SessionState):
        self.state = state
        self.signals, self._owned = session_signals()

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        runner = self.state.runner
        for pool in getattr(runner, "pools", {}).values():
            pool.kill()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session):
        self.signals.finishing()
        return (yield)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._owned:
            self.signals.restore()


class _Summary:
    """Collects per-hook outcomes, writes the "hook conformance" section, and sets the exit status.

    A hook's verdict is one of: ``DOES NOT CONFORM (checks)``; ``known failures``
    (each reason listed); ``CONFORMS``; ``NOT CHECKED ACROSS RANKS`` when every case
    of it that ran had world size 1 (a mean over one rank is the local gradient, so
    such a run proves nothing); ``not run``. Known failures that now pass (XPASS) are
    counted in the verdict and listed, never hidden behind "not run". An interrupted
    session (Ctrl-C, SIGTERM, or ``-x``/``--maxfail`` stopping before every case ran) gives
    no hook ``CONFORMS``: the section opens with ``INTERRUPTED after N of M cases``, and a
    hook without a failure is ``INTERRUPTED``.
    """

    def __init__(self, state: SessionState):
        self.state = state
        self.interrupted = False
        self.stopped_by = ""
        self.cases_run = 0
        self.cases_planned: Dict[Optional[str], int] = defaultdict(int)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            self.cases_planned[_case_hook(item)] += 1

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.cases_run += 1

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.interrupted = True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        hook = props.get("hook")
        state = self.state
        if hook is None and report.when == "setup" and report.skipped:
            # Skipped (or an unrun known failure) before the test body set its properties:
            # the hook's name leads the case id.
            try:
                hook = parse_case_id(report.nodeid)["hook"]
            except ValueError:
                hook = None
            if hook not in {item.spec.name for item in state.specs}:
                hook = None
            elif not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2].replace("Skipped: ", "", 1)
                state.skip_reasons[hook][reason] = state.skip_reasons[hook].get(reason, 0) + 1
        if hook is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        strict_xpass = report.failed and str(report.longrepr).startswith("[XPASS(strict)]")
        if hasattr(report, "wasxfail") or strict_xpass:
            outcome = "xpassed" if report.passed or strict_xpass else "xfailed"
            if outcome == "xpassed":
                state.xpassed.append(report.nodeid)
            else:
                state.xfail_reasons[hook].add(report.wasxfail)
        else:
            outcome = report.outcome
            if report.failed:
                state.per_hook_failed_checks[hook].add(props.get("check", "?"))
        if outcome != "skipped" and props.get("world_size") is not None:
            state.ran_at[hook].add(int(props["world_size"]))
        state.per_hook[hook][outcome] += 1

    def verdict(self, name: str) -> str:
        """The hook's verdict (:func:`conformance.report.hook_verdict`); never ``CONFORMS`` in a run that
        stopped before every case ran (the issue's rule: an interrupted run never says CONFORMS)."""
        state = self.state
        return report.hook_verdict(state.per_hook.get(name) or {}, state.per_hook_failed_checks.get(name, ()),
                                   state.ran_at.get(name, ()), interrupted=self.interrupted)

    def unchecked_hooks(self) -> List[str]:
        return [item.spec.name for item in self.state.specs
                if self.verdict(item.spec.name).startswith("NOT CHECKED ACROSS RANKS")]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stopped = session.shouldfail or session.shouldstop
        if stopped and self.cases_run < sum(self.cases_planned.values()):
            # -x / --maxfail stopped the run: the cases not run might fail, as after Ctrl-C.
            self.interrupted = True
            self.stopped_by = str(stopped)
        if exitstatus != 0:
            return
        state = self.state
        if self.unchecked_hooks() or (state.settings.strict_known_failures and state.unused_entries):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        state = self.state
        tr = terminalreporter
        if state.per_hook or self.interrupted:
            tr.section("hook conformance")
        if self.interrupted:
            why = f" ({self.stopped_by})" if self.stopped_by else ""
            tr.write_line(f"INTERRUPTED after {self.cases_run} of {sum(self.cases_planned.values())} cases{why}: "
                          "a hook without a failure gets no verdict, since not every case ran", red=True)
        for item in state.specs:
            name = item.spec.name
            counts = state.per_hook.get(name)
            planned = f" of {self.cases_planned[name]}" if self.interrupted else ""
            if not counts:
                if self.interrupted and self.cases_planned.get(name):
                    tr.write_line(f"{name:<28} {self.verdict(name)}  [0{planned} cases]")
                continue
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            tr.write_line(f"{name:<28} {self.verdict(name)}  [{sum(counts.values())}{planned} cases: {detail}]")
            for reason in sorted(state.xfail_reasons.get(name, ())):
                tr.write_line(f"{'':<28}   expected: {reason}")
            if not (counts.get("passed") or counts.get("failed") or counts.get("xfailed")):
                for reason, n in sorted(state.skip_reasons.get(name, {}).items()):
                    tr.write_line(f"{'':<28}   skipped ({n}): {reason}")
            for line in results_plugin.hook_matrix_lines(tr.config, name, self.verdict(name), indent=" " * 4):
                tr.write_line(line)
        if state.xpassed:
            tr.section("known failures that now pass")
            for nodeid in state.xpassed:
                tr.write_line(f"XPASS {nodeid}: remove or narrow its entry in the known-failures file")
        unchecked = self.unchecked_hooks()
        if unchecked:
            tr.write_line(f"exit status 1: {', '.join(unchecked)} ran only at world size 1, where a mean over one "
                          "rank is the local gradient; run with --world-size 2 or more (or --extra-world-size 3)",
                          red=True)
        if state.settings.strict_known_failures and state.unused_entries:
            tr.section("known-failures entries that match no test (--strict-known-failures)")
            for entry in state.unused_entries:
                tr.write_line(f"{entry.source}: test = {entry.test!r} ({entry.conditions()}): update or remove it")
        runner = state.runner
        if runner is not None and getattr(runner, "restarts", 0):
            tr.write_line(f"rank pools restarted {runner.restarts} time(s) after hung or broken cases")
        for line in getattr(runner, "memory_restarts", ()):
            tr.write_line(f"rank memory: {line}", yellow=True)
        if state.settings.listen is not None:  # connections refused for want of the shared secret
            from conformance.remote import summary_lines

            for line in summary_lines():
                tr.write_line(line, yellow=True)


@pytest.fixture(scope="session")
def conform(request: pytest.FixtureRequest):
    """The session's :class:`~conformance.runner.Runner` (rank pools start lazily)."""
    from conformance.runner import Runner

    state = state_of(request.config)
    if state.runner is None:
        state.runner = Runner(state.settings, state.specs, state.sys_path)
        s = state.settings
        wanted = set()
        for item in request.session.items:  # the pools that cases which run here need
            case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
            if getattr(case, "world_size", None) is not None and not item.get_closest_marker("skip"):
                wanted.add(case.world_size)
        state.runner.prestart(sorted(ws for ws in wanted if s.world_size_unavailable(ws) is None))
    return state.runner
