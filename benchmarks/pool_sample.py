"""The pool side of ``pool_overhead.py``: the default run, narrowed to a sample, run by the suite itself.

:func:`run_sample` runs pytest in this process on the suite, as ``conform``
does (``conformance.controller.cli.pytest_args``), with one more plugin,
:class:`SampleSession`. The suite's plugin collects the default run and marks
skips and known failures; then :class:`SampleSession` keeps a stratified
sample of the cases that run to a pass (``case_sample.py``), repeats it for
each pass, and times each test call. ``RankPool.run`` is wrapped for the
session, so the plugin sees every ``Case`` a test dispatches and can hand the
very same messages to spawn-per-case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import pytest

from case_sample import stratified_sample

#: Untimed passes over the sample first: each pool's first case pays one-off set-up.
WARMUP_PASSES = 1


@dataclasses.dataclass
class SampledCase:
    """One sampled test: its pool passes, the ``Case`` messages it dispatched, and its spawn-per-case run."""

    nodeid: str
    name: str
    api: str
    world_size: int
    #: Per pass: (wall seconds of the test call, the slowest rank's compute seconds summed over its dispatches).
    passes: List[tuple] = dataclasses.field(default_factory=list)
    cases: List[Any] = dataclasses.field(default_factory=list)
    spawn: Optional[Dict[str, Any]] = None
    #: Why the case skipped when it ran (its reference cannot run here: the suite's reference replay), or
    #: ``None``. Such a case is marked passing at collection, so it is drawn, but it is not spawned nor timed.
    skipped: Optional[str] = None

    @property
    def timed(self) -> List[tuple]:
        return self.passes[WARMUP_PASSES:]

    @property
    def pool_wall_s(self) -> float:
        return statistics.median(wall for wall, _ in self.timed)

    @property
    def pool_compute_s(self) -> float:
        return statistics.median(compute for _, compute in self.timed)

    @property
    def pool_overhead_s(self) -> float:
        return statistics.median(wall - compute for wall, compute in self.timed)


def _stratum(item: Any) -> tuple:
    case = item.callspec.params["case"]
    return (case.api, case.world_size)


def _kind(item: Any) -> str:
    if item.get_closest_marker("skip"):
        return "skipped"
    return "known failures" if item.get_closest_marker("xfail") else "passing"


class SampleSession:
    """A pytest plugin: narrow the default run to the sample, time its passes, spawn each case after its last.

    Args:
        size, seed: the sample (:func:`case_sample.stratified_sample`).
        timed_passes: timed passes after :data:`WARMUP_PASSES`.
        spawn: ``spawn(sampled_case)`` runs the case spawn-per-case and returns
            its figures; called right after the case's last pool pass, so both
            ways run under the same load. ``None``: pool only.
    """

    def __init__(self, size: int, seed: int, timed_passes: int,
                 spawn: Optional[Callable[[SampledCase], Dict[str, Any]]] = None):
        self.size = size
        self.seed = seed
        self.passes = WARMUP_PASSES + timed_passes
        self.spawn = spawn
        self.collected: Dict[str, int] = {}
        self.population: Dict[tuple, int] = {}
        self.sample: List[SampledCase] = []
        self.failures: List[str] = []
        self._dispatches: Optional[List[tuple]] = None

    @pytest.hookimpl(trylast=True)  # after the suite's plugin has marked skips and known failures
    def pytest_collection_modifyitems(self, session: Any, config: Any, items: List[Any]) -> None:
        suite = [item for item in items if item.get_closest_marker("conformance")]
        runnable = [item for item in suite if _kind(item) == "passing"]
        for item in suite:
            self.collected[_kind(item)] = self.collected.get(_kind(item), 0) + 1
        for item in runnable:
            self.population[_stratum(item)] = self.population.get(_stratum(item), 0) + 1
        chosen = stratified_sample(runnable, _stratum, self.size, self.seed)
        self.sample = [SampledCase(item.nodeid, item.name, *_stratum(item)) for item in chosen]
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        # The same items once per pass, in the suite's order each time.
        items[:] = chosen * self.passes

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: Any):
        row = next(r for r in self.sample if r.nodeid == item.nodeid)
        self._dispatches = []
        start = time.perf_counter()
        outcome = yield
        wall = time.perf_counter() - start
        dispatches, self._dispatches = self._dispatches, None
        row.passes.append((wall, sum(result.max_compute_s for _, result in dispatches)))
        excinfo = outcome.excinfo
        if excinfo is not None and isinstance(excinfo[1], pytest.skip.Exception):
            row.skipped = str(excinfo[1])
        if len(row.passes) == self.passes:
            row.cases = [case for case, _ in dispatches]
            if self.spawn is not None and row.skipped is None:
                row.spawn = self.spawn(row)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failures.append(f"{report.nodeid} ({report.when}):\n{report.longreprtext[-3000:]}")

    def record_dispatch(self, case: Any, result: Any) -> None:
        """Called with every case a rank pool runs, and its result."""
        if self._dispatches is not None:
            self._dispatches.append((case, result))


def run_sample(session: SampleSession, output: Any) -> int:
    """Run the default run's collection, narrowed by ``session``, in this process; pytest's exit code.

    pytest's own terminal output goes to ``output`` (a text stream).
    """
    from conformance.controller import cli
    from conformance.controller import local_pool as pool_mod
    from conformance.controller import zygote_client

    plain_run = pool_mod.RankPool.run

    def run(self: Any, case: Any, timeout_s: Optional[float] = None) -> Any:
        result = plain_run(self, case, timeout_s)
        session.record_dispatch(case, result)
        return result

    pool_mod.RankPool.run = run
    try:
        zygote_client.start_zygote()  # as conform does: its imports overlap this process's
        # -s: progress lines print as they come (ranks, pooled or spawned, write to their own logs).
        with contextlib.redirect_stdout(output):
            return int(pytest.main(cli.pytest_args(["-s", "-q"]), plugins=[session]))
    finally:
        pool_mod.RankPool.run = plain_run
