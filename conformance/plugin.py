"""The pytest plugin: options, the hooks under test, the rank pools, known failures, the report.

Loaded by ``conform`` (``-p conformance.plugin``) and by the repository's
``conftest.py``. The test modules in ``conformance/suite/`` ask for the
``conform`` fixture (a :class:`~conformance.runner.Runner`) and run their
cases through it; everything heavy (the rank pools) starts lazily on the
first case, so loading the plugin costs little.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import warnings
from collections import defaultdict
from typing import Dict, List, Optional

import pytest

from conformance import settings as settings_mod
from conformance.known_failures import KnownFailureBook, KnownFailuresError, RunEnvironment, load_known_failures
from conformance.plugins import LoadedSpec, ensure_importable_from_cwd, load_specs
from conformance.spec import SpecError

SUITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite")


@dataclasses.dataclass
class SessionState:
    settings: settings_mod.Settings
    specs: List[LoadedSpec]
    book: KnownFailureBook
    runner: Optional[object] = None
    per_hook: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    per_hook_failed_checks: Dict[str, set] = dataclasses.field(default_factory=lambda: defaultdict(set))
    xfail_reasons: Dict[str, set] = dataclasses.field(default_factory=lambda: defaultdict(set))
    xpassed: List[str] = dataclasses.field(default_factory=list)

    def spec(self, name: str) -> LoadedSpec:
        for item in self.specs:
            if item.spec.name == name:
                return item
        raise KeyError(name)

    def rerun_command(self, test_name: str, hook: Optional[str]) -> str:
        s = self.settings
        args = ["conform"]
        item = self.spec(hook) if hook else None
        if item is not None and item.origin == "--hook":
            args += ["--hook", item.target]
        args += s.rerun_args()
        args += ["-k", test_name]
        return " ".join(shlex.quote(a) for a in args)


_STATE_KEY = pytest.StashKey[SessionState]()


def state_of(config: pytest.Config) -> SessionState:
    return config.stash[_STATE_KEY]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "commhook-conformance")
    for opt in settings_mod.OPTIONS:
        if opt.flag in ("--with-builtins", "--no-entry-points"):
            group.addoption(opt.flag, action="store_true", dest=opt.dest, default=False, help=opt.help)
        elif opt.flag in ("--hook", "--known-failures"):
            group.addoption(opt.flag, action="append", dest=opt.dest, default=[], metavar="VALUE", help=opt.help)
        else:
            group.addoption(opt.flag, action="store", dest=opt.dest, default=None, metavar="VALUE", help=opt.help)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance(api): a conformance case run on the rank pool")
    ensure_importable_from_cwd()
    try:
        settings = settings_mod.resolve(config.getoption)
        specs = load_specs(settings.hooks, builtins=settings.builtins, entry_points=settings.entry_points)
        entries = []
        for path in settings.known_failures:
            entries += load_known_failures(path)
    except (settings_mod.SettingsError, SpecError, KnownFailuresError) as exc:
        raise pytest.UsageError(str(exc)) from None
    import torch

    env = RunEnvironment(backend=settings.backend, device=settings.device, torch_version=torch.__version__)
    state = SessionState(settings=settings, specs=specs, book=KnownFailureBook(entries, env))
    config.stash[_STATE_KEY] = state
    config.pluginmanager.register(_Summary(state), "conformance-summary")


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
    sizes = " and ".join(str(w) for w in s.world_sizes)
    lines = [f"conformance: torch {torch.__version__}, backend {s.backend}, device {s.device}, "
             f"world sizes {sizes}, case timeout {s.case_timeout_s:g} s"]
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
    for item in suite_items:
        entry = state.book.lookup(item.name)
        if entry is not None:
            prefix = "known failure, not run" if not entry.run else "known failure"
            item.add_marker(pytest.mark.xfail(reason=f"{prefix} ({entry.source}): {entry.reason}", strict=False,
                                              run=entry.run))
    hooks = [s.spec.name for s in state.specs]
    for entry in state.book.unused(hooks):
        warnings.warn(pytest.PytestWarning(
            f"known failure {entry.source} (test = {entry.test!r}, {entry.conditions()}) matches no test in this run; "
            "the failure may be fixed or the pattern out of date: update or remove the entry"))


class _Summary:
    """Collects per-hook outcomes and writes the "hook conformance" section."""

    def __init__(self, state: SessionState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        hook = props.get("hook")
        if hook is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        state = self.state
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.passed else "xfailed"
            if report.passed:
                state.xpassed.append(report.nodeid)
            else:
                state.xfail_reasons[hook].add(report.wasxfail)
        else:
            outcome = report.outcome
            if report.failed:
                state.per_hook_failed_checks[hook].add(props.get("check", "?"))
        state.per_hook[hook][outcome] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        state = self.state
        if not state.per_hook:
            return
        tr = terminalreporter
        tr.section("hook conformance")
        for item in state.specs:
            name = item.spec.name
            counts = state.per_hook.get(name)
            if not counts:
                continue
            if counts.get("failed"):
                verdict = "DOES NOT CONFORM (" + ", ".join(sorted(state.per_hook_failed_checks[name])) + ")"
            elif counts.get("xfailed"):
                verdict = "known failures"
            elif counts.get("passed"):
                verdict = "CONFORMS"
            else:
                verdict = "not run"
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            tr.write_line(f"{name:<28} {verdict}  [{sum(counts.values())} cases: {detail}]")
            for reason in sorted(state.xfail_reasons.get(name, ())):
                tr.write_line(f"{'':<28}   expected: {reason}")
        if state.xpassed:
            tr.section("known failures that now pass")
            for nodeid in state.xpassed:
                tr.write_line(f"XPASS {nodeid}: remove or narrow its entry in the known-failures file")
        runner = state.runner
        if runner is not None and getattr(runner, "restarts", 0):
            tr.write_line(f"rank pools restarted {runner.restarts} time(s) after hung or broken cases")


@pytest.fixture(scope="session")
def conform(request: pytest.FixtureRequest):
    """The session's :class:`~conformance.runner.Runner` (rank pools start lazily)."""
    from conformance.runner import Runner

    state = state_of(request.config)
    if state.runner is None:
        state.runner = Runner(state)
        s = state.settings
        wanted = set()
        for item in request.session.items:
            case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
            if getattr(case, "world_size", None) is not None:
                wanted.add(case.world_size)
        state.runner.prestart(sorted(ws for ws in wanted if s.world_size_unavailable(ws) is None))
    return state.runner
