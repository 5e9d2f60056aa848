"""The pytest plugin: options, the hooks under test, the rank pools, known failures, the report.

Loaded by ``conform`` (``-p conformance.controller.pytest_plugin``) and by the repository's
``conftest.py``. The test modules in ``conformance/suite/`` ask for the
``conform`` fixture (a :class:`~conformance.controller.runner.Runner`) and run their
cases through it; everything heavy (the rank pools) starts lazily on the
first case, so loading the plugin costs little.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import warnings
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from packaging.version import Version

from conformance.apis import is_reach_case
from conformance.apis.registry import HOOK_APIS, api_of_test, planned_cases
from conformance.cases import CaseParams
from conformance.controller import remote, settings as settings_mod
from conformance.controller.failures import ConformanceFailure, NotRun
from conformance.controller.interruption import session_signals
from conformance.controller.known_failures import KnownFailureBook, KnownFailuresError, RunEnvironment, load_known_failures
from conformance.controller.runner import Runner
from conformance.shared.spec_loading import LoadedSpec, load_specs, user_paths_first
from conformance.reports import results_plugin, session_report
from conformance.reports.bookkeeper import PLUGIN_NAME as BOOKKEEPER, Bookkeeper
from conformance.reports.report_guard import PLUGIN_NAME as REPORT_FILES, ReportGuard
from conformance.reports.summary import Summary
from conformance.reports.bookkeeper import case_hook, case_of
from conformance.signatures import SpecError

#: The oldest torch the suite runs on (README's compatibility table).
MIN_TORCH = (2, 4)


@dataclasses.dataclass
class SessionState:
    settings: settings_mod.Settings
    specs: List[LoadedSpec]
    book: KnownFailureBook
    sys_path: Tuple[str, ...] = ()
    runner: Optional[object] = None
    unused_entries: List[object] = dataclasses.field(default_factory=list)
    #: Every suite test's cases for these specs and settings, planned once (:func:`plan_every_case`).
    cases: Dict[str, List[CaseParams]] = dataclasses.field(default_factory=dict)
    #: Every world size the run plans a case at that can run here -> its suite tests (the header, the JSON).
    world_sizes: Dict[int, set] = dataclasses.field(default_factory=dict)
    #: The terminal summary's lines on the ``--listen`` listener (the connections it refused), set when the
    #: session finishes (:func:`conformance.controller.remote.summary_lines`).
    listener_lines: List[str] = dataclasses.field(default_factory=list)

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
        if not opt.metavar:  # a flag without a value (Option.metavar "")
            group.addoption(opt.flag, action="store_true", dest=opt.dest, default=False, help=opt.full_help())
        elif opt.flag in ("--hook", "--known-failures"):
            group.addoption(opt.flag, action="append", dest=opt.dest, default=[], metavar=opt.metavar,
                            help=opt.full_help())
        else:
            group.addoption(opt.flag, action="store", dest=opt.dest, default=None, metavar=opt.metavar,
                            help=opt.full_help())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a conformance case run on the rank pool")
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
    cases = plan_every_case([s.spec for s in specs], settings)
    planned = world_sizes_of(cases)
    # Each case is matched where its ranks run: a one-GPU machine's cross-rank pools are gloo on the CPU.
    book = KnownFailureBook(entries, env, placements={ws: settings.placement(ws)
                                                      for ws in {*settings.world_sizes, *planned}})
    state = SessionState(settings=settings, specs=specs, book=book, sys_path=sys_path, cases=cases,
                         world_sizes=planned)
    config.stash[_STATE_KEY] = state
    keeper = Bookkeeper(state)  # classifies every case's reports, for the summary and the results files
    config.pluginmanager.register(keeper, BOOKKEEPER)
    config.pluginmanager.register(Summary(state, keeper), "conformance-summary")
    config.pluginmanager.register(_Stopping(state), "conformance-stopping")
    config.pluginmanager.register(_CaseReports(keeper), "conformance-case-reports")
    # Before any case: an unwritable or busy report path is a usage error (the reports are marked stale later,
    # once a case is about to run).
    config.pluginmanager.register(ReportGuard(config, settings.json_path, settings.markdown_path,
                                              keep=tuple(p for p in (settings.baseline_path,) if p)), REPORT_FILES)
    results_plugin.register(config, state, keeper)  # --json, --markdown, --baseline; the per-hook grids
    # torch, the hooks' modules and the plan are here for the whole run: out of the cyclic collector's sight, each
    # collection after this (the run's own, and pytest's five at exit) scans only what the cases leave behind.
    gc.freeze()
    gc.enable()  # cli.main disabled it for the imports


def plan_every_case(specs: List[object], settings: settings_mod.Settings) -> Dict[str, List[CaseParams]]:
    """Suite test -> its cases for ``specs`` under ``settings`` (:func:`conformance.apis.registry.planned_cases`),
    for every API's suite tests: planned once per session, for the parametrization and the world sizes."""
    return {test: planned_cases(test, specs, settings) for api in HOOK_APIS.values() for test in api.plans}


def world_sizes_of(cases: Dict[str, List[CaseParams]]) -> Dict[int, set]:
    """World size -> the suite tests with a case planned there that can run here (not skipped)."""
    out: Dict[int, set] = {}
    for test, planned in cases.items():
        for case in planned:
            if case.skip is None:
                out.setdefault(case.world_size, set()).add(test)
    return out


def _release(version: str) -> Tuple[int, ...]:
    return Version(version).release


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Hand the terminal summary what it says of the ``--listen`` listener (it runs after this)."""
    state = session.config.stash.get(_STATE_KEY, None)
    if state is not None and state.settings.listen is not None:
        state.listener_lines = remote.summary_lines()


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is not None and state.runner is not None:
        state.runner.close()


def pytest_report_header(config: pytest.Config) -> List[str]:
    state = config.stash.get(_STATE_KEY, None)
    if state is None:
        return []
    return session_report.header_lines(state, torch.__version__)


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
    _order_by_hook(items, [item.spec.name for item in state.specs])
    strict = state.settings.strict_known_failures
    runs = _known_failures_run(suite_items, state.book)
    for item in suite_items:
        hook = case_hook(item)
        entry = state.book.lookup(item.name)  # first: an entry about a case that cannot run here is not stale
        missing = state.spec(hook).spec.missing_requirements() if hook else ()
        if missing:
            item.add_marker(pytest.mark.skip(reason=(
                f"hook {hook} needs {', '.join(missing)}, which is not installed here: "
                f"{sys.executable} -m pip install {' '.join(missing)}")))
            continue
        if entry is not None:
            run = runs.get(item.nodeid, entry.run)
            prefix = ("known failure, not run" if not entry.run else
                      "known failure, not run here: its other cases run and show whether it holds" if not run
                      else "known failure")
            item.add_marker(pytest.mark.xfail(reason=f"{prefix} ({entry.source}): {entry.reason}", strict=strict,
                                              run=run))
    hooks = [s.spec.name for s in state.specs]
    # An entry about world size 3 is not stale in a run without 3 ranks (--extra-world-size 0, --listen).
    sizes = {getattr(case_of(item), "world_size", None) for item in suite_items}
    state.unused_entries = state.book.unused(hooks, world_sizes=sizes - {None})
    for entry in state.unused_entries:
        warnings.warn(pytest.PytestWarning(
            f"known failure {entry.source} (test = {entry.test!r}, {entry.conditions()}) matches no test in this run; "
            "the failure may be fixed or the pattern out of date: update or remove the entry"))


def _known_failures_run(items: List[pytest.Item], book: KnownFailureBook) -> Dict[str, bool]:
    """Which known-failure cases run: node id -> whether it runs (its entry's ``run``, unless one of these says
    not). A case a known failure marks shows whether the failure still holds; where others show it, a case
    that would only cost seconds to fail the same way is reported without running:

    * an entry with ``sample = true`` (its failure does not depend on the case) runs its first case of each
      suite test and world size;
    * a reach case (:func:`~conformance.apis.is_reach_case`: production-sized buffers, a long run, a simulated
      layout) whose entry also marks cases that run and are not the reach's.
    """
    entries = {item.nodeid: book.lookup(item.name) for item in items}
    held_elsewhere = {id(entry) for item in items for entry in [entries[item.nodeid]]
                      if entry is not None and entry.run and case_of(item) is not None
                      and not is_reach_case(case_of(item))}
    sampled = set()
    out: Dict[str, bool] = {}
    for item in items:
        entry, case = entries[item.nodeid], case_of(item)
        if entry is None or not entry.run or case is None:
            continue
        if entry.sample:
            first = (id(entry), item.name.split("[", 1)[0], case.world_size)
            out[item.nodeid] = first not in sampled
            sampled.add(first)
        elif id(entry) in held_elsewhere and is_reach_case(case):
            out[item.nodeid] = False
    return out


def _order_by_hook(items: List[pytest.Item], hooks: List[str]) -> None:
    """Put each hook's cases together, hooks in the order they were given, each hook's cases in their
    collected order; other items keep their places. Each hook gets rank processes of its own
    (:meth:`conformance.controller.runner.Runner.serve`), started once for all its cases."""
    rank = {name: i for i, name in enumerate(hooks)}
    slots = [i for i, item in enumerate(items) if item.get_closest_marker("conformance")]
    ordered = sorted((items[i] for i in slots), key=lambda item: rank.get(case_hook(item), len(rank)))
    for i, item in zip(slots, ordered):
        items[i] = item


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize a suite test with its API's case plan (:attr:`conformance.apis.HookApi.plans`).

    A case that cannot run here is a skip with its reason: the world size's
    availability first (:meth:`Settings.world_size_unavailable`), then the plan's.
    """
    state = metafunc.config.stash.get(_STATE_KEY, None)
    if state is None or "case" not in metafunc.fixturenames or not metafunc.definition.get_closest_marker("conformance"):
        return
    if api_of_test(metafunc.function.__name__) is None:
        return
    params = [pytest.param(case, id=case.id, marks=[pytest.mark.skip(reason=case.skip)] if case.skip else [])
              for case in state.cases[metafunc.function.__name__]]
    metafunc.parametrize("case", params)


class _CaseReports:
    """The suite's one ``pytest_runtest_makereport``, for every phase of every test.

    Registered after pytest's own runner, so pluggy asks it before the runner (and after ``_pytest.unittest``'s,
    which answers only for unittest items); wrappers (``_pytest.skipping``'s xfail handling among them) see the
    report it returns as any other. It:

    * has the bookkeeper note a case's failure before the report is built
      (:meth:`~conformance.reports.bookkeeper.Bookkeeper.note_report`: the failure's figures join the case's JUnit
      properties, its text and re-run command its record);
    * gives the test the properties the verdicts read: ``leak`` and ``failed_check`` for what a hook left behind
      (:data:`LEAK_LABELS`), ``not_run`` for a :class:`~conformance.controller.failures.NotRun` case; on the item,
      which the report copies (JUnit XML and the results file read the properties of the teardown report too);
    * answers a :class:`~conformance.controller.failures.ConformanceFailure` with a report whose ``longrepr`` is
      its message alone: the message is the whole report of the case (findings, each rank's own traceback, the
      re-run command), and pytest's traceback through the suite's test function adds nothing a hook author can
      act on, whatever ``--tb`` says, while rendering it costs tens of milliseconds a case, for hundreds of known
      failures in a default run. A string ``longrepr`` is printed as it is by every ``--tb`` style and written
      whole into JUnit XML (``<failure message=...>`` and its text). A known failure that is not run
      (``xfail(run=False)``) raises pytest's ``XFailed`` in its setup, answered the same way: its reason is the
      report's ``wasxfail``. Any other exception (a bug in the suite) keeps pytest's traceback.
    """

    def __init__(self, keeper: Bookkeeper):
        self.keeper = keeper

    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Optional[pytest.TestReport]:
        self.keeper.note_report(item, call)
        if call.excinfo is None:
            return None
        exc = call.excinfo.value
        if isinstance(exc, NotRun):
            item.user_properties.append(("not_run", exc.reason))
            return None
        if isinstance(exc, ConformanceFailure):
            kinds = {f.kind for f in exc.findings}
            item.user_properties.extend(("leak", label) for kind, label in LEAK_LABELS.items() if kind in kinds)
            if kinds and kinds <= set(LEAK_LABELS) and not exc.rank_problems:
                item.user_properties.append(("failed_check", "; ".join(LEAK_LABELS[k] for k in sorted(kinds))))
            return self._message_only(item, call, exc)
        if isinstance(exc, pytest.xfail.Exception) and item.get_closest_marker("conformance") is not None:
            return self._message_only(item, call, exc)  # a known failure that is not run
        return None  # a bug in the suite: pytest's traceback

    @staticmethod
    def _message_only(item: pytest.Item, call: pytest.CallInfo, exc: BaseException) -> pytest.TestReport:
        """The report pytest would build, its ``longrepr`` the exception's message alone."""
        return pytest.TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
                                 str(exc), call.when, sections=list(item._report_sections),
                                 duration=call.duration, start=call.start, stop=call.stop,
                                 user_properties=item.user_properties)


#: Finding kinds that are something the hook left behind rather than a check's own finding, with what the
#: verdict calls them (``DOES NOT CONFORM (left process state changed)``).
LEAK_LABELS = {"process_state": "left process state changed", "memory": "memory growth"}


class _Stopping:
    """SIGTERM is handled as Ctrl-C (:class:`~conformance.controller.interruption.StopSignals`), and an interrupted
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


@pytest.fixture(scope="session")
def conform(request: pytest.FixtureRequest):
    """The session's :class:`~conformance.controller.runner.Runner`: every spec loaded once inside a rank, then the
    first hook's pools launched (the rest start when their hook's turn comes)."""
    state = state_of(request.config)
    if state.runner is None:
        runner = state.runner = Runner(state.settings, state.specs, state.sys_path)
        s = state.settings
        first: List[Optional[str]] = []
        for item in request.session.items:  # the pools that cases which run here need, hook by hook
            case = case_of(item)
            ws = getattr(case, "world_size", None)
            if ws is None or item.get_closest_marker("skip") or s.world_size_unavailable(ws) is not None:
                continue
            runner.world_sizes_of.setdefault(case.hook, set()).add(ws)
            if not first:
                first.append(case.hook)
        if not runner.remote:  # torchrun's ranks load each spec when its hook's turn comes
            runner.check_specs()
        if first:
            runner.prestart(first[0])
    return state.runner
