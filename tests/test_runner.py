"""Tests for conformance.controller.runner: where each pool runs, and a reference that cannot run here is a skip.

The pool is replaced by a scripted one, so these tests say exactly which rank
outcomes lead to which verdict, without starting a process.
"""

from __future__ import annotations

import dataclasses
import types
from typing import List

import pytest

from conformance.shared.spec_loading import LoadedSpec
from conformance.protocol import CaseResult, CheckResult, RankOutcome
from conformance.controller.failures import ConformanceFailure
from conformance.controller.runner import Runner
from conformance.controller.settings import resolve
from conformance.spec import HookSpec

WRITEBACK = ("Traceback (most recent call last):\n  File \"_flat_param.py\", line 2351, in _writeback_tensor\n"
             "RuntimeError: Cannot writeback when the parameter shape changes\n"
             "Expects torch.Size([32]) but got torch.Size([4, 8])\n")


class ScriptedPool:
    """Answers each run with the next scripted list of rank outcomes, and records the cases."""

    config = types.SimpleNamespace(world_size=2)  # all of PoolConfig the runner reads, where a pool cannot start

    def __init__(self, script: List[List[RankOutcome]]):
        self.script = list(script)
        self.cases = []

    def run(self, case):
        self.cases.append(case)
        outcomes = tuple(self.script.pop(0))
        return CaseResult(case=case, world_size=len(outcomes), outcomes=outcomes,
                          pool_rebuilt=any(o.exit_code is not None for o in outcomes))  # a dead rank takes the pool


def raised(rank: int, phase: str) -> RankOutcome:
    return RankOutcome(rank=rank, error=WRITEBACK, error_type="RuntimeError", phase=phase)


def ok(rank: int) -> RankOutcome:
    return RankOutcome(rank=rank, ok=True, value=CheckResult())


def make_runner(gpu_count: int = 0, sys_path=()) -> Runner:
    """A Runner over the default settings of a machine with ``gpu_count`` GPUs and one spec."""
    settings = resolve(lambda dest: [] if dest in ("conform_hooks", "conform_known_failures") else None,
                       env={}, gpu_count=gpu_count)
    hook_spec = HookSpec(name="h", api="fsdp2_all_reduce", hook=lambda t: None)
    return Runner(settings, [LoadedSpec("pkg.mod:SPEC", hook_spec)], sys_path)


@pytest.fixture
def runner():
    return make_runner()


def run_case(runner, pool, check="fsdp.parity"):
    runner.pools[2] = pool
    runner.serving = "h"  # the scripted pool serves the hook already
    return runner.run("test_parity[h-NO_SHARD-m-ws2]", check=check, hook="h", params={"model": "m"},
                      world_size=2, describe={"check": "parity", "model": "m"})


def test_a_reference_that_fails_alone_too_skips_the_case_with_its_error(runner):
    phase = "step 1: forward/backward of the reference model"
    pool = ScriptedPool([[raised(0, phase), raised(1, phase)], [raised(0, phase), ok(1)]])
    with pytest.raises(pytest.skip.Exception) as info:
        run_case(runner, pool)
    reason = str(info.value)
    assert "the suite's reference (check=parity model=m, no hook under test) cannot run here" in reason
    assert "RuntimeError: Cannot writeback when the parameter shape changes" in reason
    assert pool.cases[1].params == {"model": "m", "reference_only": True}


def test_a_reference_that_trains_alone_means_the_hook_broke_it(runner):
    phase = "step 1: forward/backward of the reference model"
    pool = ScriptedPool([[raised(0, phase), raised(1, phase)], [ok(0), ok(1)]])
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    assert "the reference trained alone, with no hook, runs here" in str(info.value)


def test_a_failure_in_the_hooked_model_is_the_hook_s_and_replays_nothing(runner):
    pool = ScriptedPool([[raised(0, "step 0: forward/backward of the hooked model"), ok(1)]])
    with pytest.raises(ConformanceFailure):
        run_case(runner, pool)
    assert len(pool.cases) == 1


def test_checks_without_a_reference_replay_are_not_replayed(runner):
    pool = ScriptedPool([[raised(0, "step 0: forward/backward of the reference model"), ok(1)]])
    with pytest.raises(ConformanceFailure):
        run_case(runner, pool, check="fsdp.averaging")
    assert len(pool.cases) == 1


def test_each_world_size_gets_the_backend_and_device_of_its_placement():
    """One GPU: world size 1 on NCCL/CUDA, the added cross-rank pools on gloo/CPU, all with one import path."""
    runner = make_runner(gpu_count=1, sys_path=("/user/repo", "/site-packages"))
    configs = {ws: runner.pool(ws, "h").config for ws in runner.settings.world_sizes}
    assert {ws: (c.backend, c.device) for ws, c in configs.items()} == {
        1: ("nccl", "cuda"), 2: ("gloo", "cpu"), 3: ("gloo", "cpu")}
    assert all(c.sys_path == ("/user/repo", "/site-packages") and c.specs == (("pkg.mod:SPEC", "h"),)
               for c in configs.values())


class RecordingPool:
    """A pool that records what the runner does with it (nothing starts)."""

    def __init__(self, config):
        self.config = config
        self.events = []
        self.alive = False

    def serve(self, specs):
        if specs != self.config.specs:
            self.events.append(("close", self.config.specs))
            self.alive = False
            self.config = dataclasses.replace(self.config, specs=specs)

    def launch(self):
        self.events.append(("launch", self.config.specs))
        self.alive = True

    def reap(self):
        if self.events and self.events[-1] != ("reap",):
            self.events.append(("reap",))


def test_another_hook_gets_fresh_pools_at_every_world_size_it_needs():
    """Each hook's ranks are its own: serving another hook closes every pool that loaded the last one, and
    launches the new hook's pools together, at the world sizes its cases need."""
    settings = resolve(lambda dest: [] if dest in ("conform_hooks", "conform_known_failures") else None,
                       env={}, gpu_count=0)
    specs = [LoadedSpec("pkg.a:SPEC", HookSpec(name="a", api="fsdp2_all_reduce", hook=lambda t: None)),
             LoadedSpec("pkg.b:SPEC", HookSpec(name="b", api="fsdp2_all_reduce", hook=lambda t: None))]
    runner = Runner(settings, specs)
    runner.world_sizes_of = {"a": {2, 3}, "b": {2}}
    made = {}
    import conformance.controller.runner as runner_mod

    original = runner_mod.RankPool
    runner_mod.RankPool = lambda config: made.setdefault(config.world_size, RecordingPool(config))
    try:
        runner.serve("a")
        launch_a, reap = ("launch", (("pkg.a:SPEC", "a"),)), ("reap",)
        assert {ws: p.events for ws, p in made.items()} == {2: [launch_a, reap], 3: [launch_a, reap]}
        assert runner.pool(2, "a") is made[2] and made[2].events == [launch_a, reap]
        runner.serve("b")
    finally:
        runner_mod.RankPool = original
    # a's ranks are told to stop, b's launched, and only then are a's waited for (they exit while b's start)
    assert made[2].events[2:] == [("close", (("pkg.a:SPEC", "a"),)), ("launch", (("pkg.b:SPEC", "b"),)), reap]
    assert made[3].events[2:] == [("close", (("pkg.a:SPEC", "a"),)), reap], "b needs no 3-rank pool: a's is closed"
    assert made[3].config.specs == (("pkg.b:SPEC", "b"),)


def test_both_launchers_offer_every_method_of_the_pool_protocol_with_its_signature():
    """The runner is typed against :class:`~conformance.controller.pools.Pool` alone: the local pool and
    torchrun's must each offer all of it, each method taking the protocol's parameters (by name, in order;
    a launcher may add optional ones after them)."""
    import inspect

    from conformance.controller.local_pool import RankPool
    from conformance.controller.pools import Pool
    from conformance.controller.remote import RemotePool

    members = [name for name, value in vars(Pool).items() if not name.startswith("_") and
               (callable(value) or isinstance(value, property))]
    assert {"alive", "launch", "wait_ready", "serve", "run", "close", "kill"} <= set(members)
    for launcher in (RankPool, RemotePool):
        for name in members:
            ours, theirs = getattr(Pool, name), getattr(launcher, name, None)
            assert theirs is not None, f"{launcher.__name__} has no {name}"
            if isinstance(ours, property):
                assert isinstance(theirs, property), f"{launcher.__name__}.{name} is no property"
                continue
            want = list(inspect.signature(ours).parameters.values())
            got = list(inspect.signature(theirs).parameters.values())
            assert [p.name for p in got[:len(want)]] == [p.name for p in want], f"{launcher.__name__}.{name}"
            assert all(p.default is not inspect.Parameter.empty for p in got[len(want):]), f"{launcher.__name__}.{name}"
            assert [p.default for p in got[:len(want)]] == [p.default for p in want], f"{launcher.__name__}.{name}"


def findings_run(runner, findings):
    """One case whose every rank finished with ``findings`` (each on its own rank)."""
    outcomes = [RankOutcome(rank=r, ok=True, value=CheckResult(findings=[f for f in findings if f.rank == r]))
                for r in range(2)]
    native = [RankOutcome(rank=r, ok=True, value=CheckResult(figures={"reference_digest": "same"})) for r in range(2)]
    # a finding that names no cause of the hook's own has native trained twice first: the same bits, twice
    return run_case(runner, ScriptedPool([outcomes, native, native]))


def test_findings_that_hold_whatever_the_hook_is_never_fail_it(runner):
    """PyTorch's rule findings skip the case; the suite's own make it NOT RUN; any other finding lets it fail."""
    from conformance.controller.failures import NotRun
    from conformance.protocol import Finding

    torch_changed = Finding(0, "PyTorch changed (torch 9.9): the setter recursed", kind="torch_rule_broken")
    suites = Finding(1, "the suite's registration missed a group", kind="suite_rule_broken")
    hooks = Finding(1, "gradient differs", kind="mismatch")
    findings_run(runner, [])
    with pytest.raises(ConformanceFailure, match="gradient differs"):  # the hook's own finding: the case fails
        findings_run(runner, [torch_changed, hooks])
    with pytest.raises(pytest.skip.Exception, match=r"^PyTorch changed \(torch 9.9\): the setter recursed$") as skip:
        findings_run(runner, [torch_changed, Finding(1, torch_changed.message, kind="torch_rule_broken")])
    assert not isinstance(skip.value, NotRun)
    with pytest.raises(NotRun, match="a rule that holds whatever the hook is, and that the suite's other checks rely "
                                     "on, fails here: the suite's registration missed a group\nPyTorch changed"):
        findings_run(runner, [torch_changed, suites])


def died(rank: int, phase: str, code: int = -6) -> RankOutcome:
    return RankOutcome(rank=rank, exit_code=code, phase=phase, output="terminate called after throwing\n")


def test_a_dead_rank_reruns_the_case_in_fresh_ranks_once_per_hook(runner):
    """First case: a rank dies, the re-run (fresh ranks) finishes: the case passes, the death is kept. Second
    case: a rank dies again: no second re-run for that hook (the script has no third answer), it fails."""
    phase = "step 1: full_tensor() of every gradient"
    pool = ScriptedPool([[died(0, phase), raised(1, phase)], [ok(0), ok(1)], [ok(0), died(1, phase, 17)]])
    run_case(runner, pool)
    assert len(pool.cases) == 2 and pool.cases[1] == pool.cases[0]
    (rerun,) = runner.crash_reruns
    assert (rerun.hook, rerun.second_run) == ("h", "ran to the end")
    assert rerun.death == ("rank 0: died with exit code -6 during 'step 1: full_tensor() of every gradient' "
                           "(it printed: terminate called after throwing)")
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    assert "rank 1: died with exit code 17" in str(info.value) and "run twice" not in str(info.value)
    assert len(runner.crash_reruns) == 1 and not pool.script


def test_a_rank_that_dies_in_fresh_ranks_too_fails_saying_the_case_ran_twice(runner):
    phase = "step 0: forward/backward of the hooked model"
    pool = ScriptedPool([[ok(0), died(1, phase, -9)], [ok(0), died(1, phase, -9)]])
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    assert "the case was run twice, the second time in fresh ranks of its own" in str(info.value)
    assert runner.crash_reruns[0].second_run == "a rank died again"


def test_a_rerun_that_raises_is_reported_as_such(runner):
    phase = "step 0: forward/backward of the hooked model"
    pool = ScriptedPool([[ok(0), died(1, phase)], [raised(0, phase), ok(1)]])
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    assert "rank 0: raised RuntimeError" in str(info.value) and "run twice" in str(info.value)
    assert runner.crash_reruns[0].second_run == "a rank raised or hung"


class UnstartablePool(ScriptedPool):
    """Its first answer is a dead rank; it cannot start again (torchrun's restarts spent)."""

    def run(self, case):
        from conformance.controller.pools import PoolStartError

        if self.script:
            return super().run(case)
        raise PoolStartError("")  # no message at all: the note must still read


def test_a_rerun_that_cannot_start_keeps_the_first_failure_and_spends_the_hooks_rerun(runner):
    phase = "step 0: forward/backward of the hooked model"
    pool = UnstartablePool([[ok(0), died(1, phase, -11)]])
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    assert "rank 1: died with exit code -11" in str(info.value)
    assert "(a rank died, and the case could not run again in fresh ranks)" in str(info.value)
    (rerun,) = runner.crash_reruns
    assert rerun.second_run == "could not start" and rerun.hook == "h"


@pytest.mark.parametrize("code", [0, 3, 17])
def test_a_rank_that_ends_its_own_process_in_the_hooks_case_fails_it_at_once(runner, code):
    """An exit status of the rank's own (``sys.exit`` that ends the process, ``os._exit``) is the hook's doing: no
    re-run in fresh ranks (the script has no second answer), and the failure says why; the hook keeps its re-run."""
    pool = ScriptedPool([[ok(0), died(1, "step 0: forward/backward of the hooked model", code)]])
    with pytest.raises(ConformanceFailure) as info:
        run_case(runner, pool)
    message = str(info.value)
    assert f"rank 1: died with exit code {code}" in message and "run twice" not in message
    assert f"rank 1 ended its own process, exit status {code}, in the hook's case" in message
    assert len(pool.cases) == 1 and runner.crash_reruns == []


def test_the_suites_own_exit_of_a_rank_whose_controller_went_is_not_the_hooks(runner):
    """Exit status 75 is the lifeline's (the rank's controller is gone): no exit of the hook's, so it is re-run."""
    from conformance.protocol import LOST_CONTROLLER_EXIT_CODE

    phase = "step 0: forward/backward of the hooked model"
    run_case(runner, ScriptedPool([[ok(0), died(1, phase, LOST_CONTROLLER_EXIT_CODE)], [ok(0), ok(1)]]))
    assert runner.crash_reruns[0].second_run == "ran to the end"


class FailingStartPool(ScriptedPool):
    """A pool whose ranks cannot start (``error``: a ``PoolStartError``, or its ``SpecLoadError``)."""

    def __init__(self, error: Exception):
        super().__init__([])
        self.error = error

    def run(self, case):
        raise self.error


@pytest.mark.parametrize("error", ["PoolStartError", "SpecLoadError"])
def test_only_a_cases_own_run_makes_a_pool_that_cannot_start_not_run_or_a_usage_error(runner, error):
    """``Runner.run_on``: every run of a case passes there, but only the case's own run turns a pool that cannot
    start into ``NOT RUN`` (or, a spec that cannot load, the session's usage error); a replay's is raised as it
    came, for ``replays.replay`` to record (its spec is PyTorch's default hook, never the user's)."""
    from conformance.controller import pools
    from conformance.controller.failures import NotRun
    from conformance.protocol import Case, HookRef

    case = Case(check="fsdp.parity", hook=HookRef(target="pkg.mod:SPEC", name="h"), params={}, case_id="c")
    kind = getattr(pools, error)
    with pytest.raises(kind):
        runner.run_on(FailingStartPool(kind("no ranks")), case, own=False)
    assert runner.not_run == {}
    expected = pytest.exit.Exception if error == "SpecLoadError" else NotRun
    with pytest.raises(expected):
        runner.run_on(FailingStartPool(kind("no ranks")), case)
    assert (runner.not_run == {("h", 2): "no ranks"}) is (error == "PoolStartError")
