"""Meta-tests: the suite catches every known-bad hook and passes every known-good one.

The shape, written once for every zoo (``tests/meta_zoos/``: FSDP1 hooks, DDP hooks, FSDP2
comms and hooks, lossy contracts): one run of the conformance suite (``python -m conformance``,
as a user runs it) over the zoo, judged by its JUnit XML. Every bad hook has an expected
catch; the run fails because of them; each good hook passes every case; each bad hook is
caught by its check (or config); a failure names everything needed to act on it, and its
re-run command reproduces exactly that case; failures carry their named cause, and the hint
to declare a lossy contract only where no named cause explains them. Tests specific to one
API read the same run: ``tests/test_meta_{fsdp,ddp,fsdp2,lossy}.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.meta_helpers import BackgroundJob, rerun_args, run_suite
from tests.meta_zoos import ZOOS


def _each(attribute):
    """(zoo, item) for every item of ``attribute`` of every zoo, with ids ``zoo-hook``: a ``Catch`` names its hook, a
    ``HookSpec`` is named by its ``name`` (its ``hook`` is the callable, whose repr carries a memory address)."""
    return pytest.mark.parametrize("zoo, item", [
        pytest.param(zoo, item, id=f"{zoo.name}-{item.hook if isinstance(item.hook, str) else item.name}")
        for zoo in ZOOS for item in getattr(zoo, attribute)])


def _zoos(having=None):
    return pytest.mark.parametrize("zoo", [z for z in ZOOS if having is None or getattr(z, having)],
                                   ids=lambda z: z.name)


@_zoos()
def test_every_bad_hook_has_an_expected_catch(zoo):
    assert {c.hook for c in zoo.catches} | zoo.caught_elsewhere == zoo.bad == zoo.documented
    assert len({c.hook for c in zoo.catches}) == len(zoo.catches), "one catch per bad hook"


@_zoos()
def test_run_fails_because_of_bad_hooks(zoo_runs, zoo):
    run = zoo_runs(zoo)
    assert run.returncode == 1, run.output[-3000:]


@_each("good")
def test_known_good_hook_passes_every_case(zoo_runs, zoo, item):
    cases = zoo_runs(zoo).by_hook()[item.name]
    assert cases, f"{item.name} was not run"
    bad = [f"{c.name}: {c.outcome}\n{c.message[:2000]}" for c in cases if c.outcome not in zoo.good_outcomes]
    assert not bad, "\n".join(bad)
    if zoo.good_coverage is not None:
        prop, want, exact = zoo.good_coverage(item)
        ran = {c.properties.get(prop) for c in cases if c.outcome == "passed"}
        assert (ran == want) if exact else (want <= ran), f"{item.name} passed {prop} {sorted(ran)}, not {sorted(want)}"


@_each("catches")
def test_known_bad_hook_is_caught(zoo_runs, zoo, item):
    cases = zoo_runs(zoo).by_hook()[item.hook]
    assert cases, f"{item.hook} was not run"
    caught = {c.properties.get(item.by) for c in cases if c.outcome == "failed"}
    missing = item.values - caught
    assert not missing, f"{item.hook} was not caught by {item.by} {sorted(missing)} (caught by: {sorted(caught)})"
    if item.only:  # every other check passes it: the class is invisible without them
        assert caught == item.values, sorted(caught)
    errors = [c.name for c in cases if c.outcome == "error"]
    assert not errors, f"{item.hook} produced setup/teardown errors instead of verdicts: {errors}"


@_zoos("acting")
def test_failure_names_everything_needed_to_act(zoo_runs, zoo):
    """Hook, check, strategy or config, model, world size, rank, step, FQN, index, ULP diff, re-run command."""
    msg = zoo.acting.case(zoo_runs(zoo)).message
    for needle in zoo.acting_needles:
        assert needle in msg, f"{needle!r} missing from:\n{msg}"


def _reruns(runs, directory, env):
    """Each zoo's picked failure re-run with the command its message ends with, after the zoo runs."""
    out = {}
    for zoo in (z for z in ZOOS if z.rerun):
        case = zoo.rerun.case(runs(zoo))
        out[zoo.name] = case, run_suite(rerun_args(case.message), os.path.join(directory, f"{zoo.name}.xml"),
                                        env=env)
    return out


#: The re-runs, in the zoo runs' background threads once the zoo runs are done (``tests/conftest.py``).
RERUNS = BackgroundJob("reruns", _reruns)


@_zoos("rerun")
def test_rerun_command_reproduces_exactly_that_case(zoo_runs, zoo):
    case, rerun = zoo_runs(RERUNS)[zoo.name]
    assert case.outcome == "failed", case.name
    assert rerun.returncode == 1, rerun.output[-3000:]
    assert [c.name for c in rerun.cases] == [case.name]
    assert rerun.cases[0].outcome == "failed"


def _cause_id(zoo, cause):
    checks = "-".join(cause.check) if isinstance(cause.check, tuple) else cause.check
    return f"{zoo.name}-{cause.hook}-{checks}" + ("-no_hint" if cause.no_lossy_hint else "")


@pytest.mark.parametrize("zoo, cause", [pytest.param(zoo, cause, id=_cause_id(zoo, cause))
                                        for zoo in ZOOS for cause in zoo.causes])
def test_failures_carry_the_named_cause(zoo_runs, zoo, cause):
    """Each failure carries its named cause (or the hint to declare a LossyContract where no named cause
    explains it); where a named exact cause explains it, no LossyContract hint."""
    failed = cause.cases(zoo_runs(zoo))
    assert failed, f"{cause.hook} did not fail {cause.check}"
    for text in cause.texts:
        missing = [c.name for c in failed if text not in c.message]
        assert not missing, f"{text!r} missing from {missing}:\n{failed[0].message[-2000:]}"
    if cause.no_lossy_hint:
        hinted = [c.name for c in failed if "LossyContract" in c.message]
        assert not hinted, f"a LossyContract hint where a named cause explains: {hinted}"
