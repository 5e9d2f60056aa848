"""Meta-tests: the suite catches every known-bad hook and passes every known-good one.

One run of the conformance suite (``python -m conformance``, as a user runs it)
over the zoo in ``tests/zoo/fsdp_hooks.py``, judged by its JUnit XML. Each
bad hook must fail at least the check named in ``MUST_CATCH``; each good hook
must pass every case. The run skips the two largest parity models to stay
quick; those models are exercised by the default ``make conform`` run.
"""

from __future__ import annotations

import pytest
import torch

from tests.meta_helpers import rerun_args, run_suite
from tests.zoo import fsdp_hooks as zoo

#: The check that must catch each known-bad hook (see zoo.EXPECTED_CATCH for why).
MUST_CATCH = {
    "bad_sum_no_average": {"averaging", "parity", "clip_grad_norm"},
    "bad_divide_after": {"hard_inputs"},
    "bad_wrong_shard": {"parity"},
    "bad_stale_after_first_step": {"parity"},
    "bad_no_cast_back": {"parity"},
    "bad_local_only": {"averaging", "parity", "rank_consistency"},
    "bad_power_of_two_divisor": {"averaging", "parity"},
    "bad_rank0_only_noise": {"parity", "rank_consistency"},
    "bad_nan_to_zero": {"hard_inputs"},
    "bad_default_group": {"subgroup_parity"},
    "bad_sum_then_divide": {"hard_inputs"},
    "bad_fp32_accumulate": {"clip_grad_norm_low_precision"},
}


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    junit = str(tmp_path_factory.mktemp("zoo") / "zoo.xml")
    run = run_suite(["--hook", "tests.zoo.fsdp_hooks:ALL", "--hypothesis-examples", "2", "-q",
                     "-k", "not transformer_shared and not always_wrap_nested"], junit)
    assert run.cases, f"the suite wrote no JUnit cases; output:\n{run.output[-4000:]}"
    return run


def test_every_bad_hook_has_an_expected_catch():
    assert set(MUST_CATCH) == {s.name for s in zoo.KNOWN_BAD} == set(zoo.EXPECTED_CATCH)


def test_run_fails_because_of_bad_hooks(zoo_run):
    assert zoo_run.returncode == 1, zoo_run.output[-3000:]


@pytest.mark.parametrize("name", [s.name for s in zoo.KNOWN_GOOD])
def test_known_good_hook_passes_every_check(zoo_run, name):
    cases = zoo_run.by_hook()[name]
    spec = next(s for s in zoo.KNOWN_GOOD if s.name == name)
    # The float16-gradient clip case is planned, and skipped with its reason, for other claims.
    low_precision = {"clip_grad_norm_low_precision"} if spec.reduce_dtype in (None, torch.float16) else set()
    assert {c.check for c in cases} == {"averaging", "parity", "rank_consistency", "registration", "hard_inputs",
                                        "subgroup_parity", "clip_grad_norm"} | low_precision
    bad = [f"{c.name}: {c.outcome}\n{c.message[:2000]}" for c in cases if c.outcome != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MUST_CATCH))
def test_known_bad_hook_is_caught(zoo_run, name):
    cases = zoo_run.by_hook()[name]
    assert cases, f"{name} was not run"
    failed_checks = {c.check for c in cases if c.outcome == "failed"}
    missing = MUST_CATCH[name] - failed_checks
    assert not missing, f"{name} was not caught by {sorted(missing)} (failed: {sorted(failed_checks)})"
    errors = [c.name for c in cases if c.outcome == "error"]
    assert not errors, f"{name} produced setup/teardown errors instead of verdicts: {errors}"


def test_power_of_two_divisor_is_only_caught_at_world_size_three(zoo_run):
    """Dividing by 4 instead of 3 is exact at 2 ranks: only the non-power-of-two world size catches it."""
    cases = zoo_run.by_hook()["bad_power_of_two_divisor"]
    failed = [c for c in cases if c.outcome == "failed"]
    assert failed and all(c.properties.get("world_size") == "3" for c in failed), [c.name for c in failed]
    assert any(c.outcome == "passed" and c.properties.get("world_size") == "2" and c.check == "parity"
               for c in cases)


def test_no_cast_back_is_caught_by_the_hook_output_dtype(zoo_run):
    """FSDP casts the gradient back itself, so only the recorded hook output shows the bug."""
    messages = [c.message for c in zoo_run.by_hook()["bad_no_cast_back"] if c.check == "parity"]
    assert messages and all("left its reduced gradient in float16" in m for m in messages)


def test_failure_names_everything_needed_to_act(zoo_run):
    """Hook, check, strategy, model, world size, rank, step, FQN, index, abs and ULP diff, re-run command."""
    case = next(c for c in zoo_run.by_hook()["bad_rank0_only_noise"]
                if c.check == "parity" and c.properties.get("model") == "net_wrapped"
                and c.properties.get("strategy") == "NO_SHARD" and c.properties.get("world_size") == "2")
    msg = case.message
    for needle in ("hook bad_rank0_only_noise does not conform", "check=parity", "strategy=NO_SHARD",
                   "model=net_wrapped", "world_size=2", "[rank 0, step 0, parameter '", "first difference at index",
                   "max abs diff", "max ULP diff 1", "Re-run just this case:",
                   "-k 'test_parity[bad_rank0_only_noise-NO_SHARD-net_wrapped-ws2]'"):
        assert needle in msg, f"{needle!r} missing from:\n{msg}"


#: hook -> (check, the diagnosis its failures must carry).
DIAGNOSED = {
    "bad_sum_no_average": ("parity", "SUM without averaging"),
    "bad_wrong_shard": ("parity", "the reduced shard of rank"),
    "bad_stale_after_first_step": ("parity", "the result of step 0 (stale)"),
    "bad_local_only": ("parity", "the hook never communicated"),
    "bad_nan_to_zero": ("hard_inputs", "NaN or Inf replaced"),
    "bad_power_of_two_divisor": ("parity", "divided as for 4 ranks"),
}


@pytest.mark.parametrize("name", sorted(DIAGNOSED))
def test_failures_carry_the_named_cause(zoo_run, name):
    check, cause = DIAGNOSED[name]
    failed = [c for c in zoo_run.by_hook()[name] if c.check == check and c.outcome == "failed"]
    assert failed, f"{name} did not fail {check}"
    missing = [c.name for c in failed if cause not in c.message]
    assert not missing, f"{cause!r} missing from {missing}:\n{failed[0].message[-2000:]}"


def test_subgroup_failures_are_diagnosed_on_the_subgroup(zoo_run):
    """The diagnosis runs its collectives on the subgroup, with the subgroup's ranks (a subgroup context keeps
    the global rank): every rank finishes and the cause is named."""
    failed = [c for c in zoo_run.by_hook()["bad_sum_no_average"] if c.check == "subgroup_parity"]
    assert failed and all(c.outcome == "failed" for c in failed)
    for case in failed:
        assert "did not finish" not in case.message, case.message[:3000]
        assert "SUM without averaging" in case.message, case.message[-2000:]


def test_an_unexplained_difference_gets_no_invented_cause(zoo_run):
    """One ULP added on rank 0 matches no named cause: rank 0 says so; the other ranks' own results are
    native's, which the diagnosis says instead of naming a cause."""
    for case in [c for c in zoo_run.by_hook()["bad_rank0_only_noise"] if c.check == "parity" and c.outcome == "failed"]:
        diagnosis = case.message.split("Diagnosis", 1)[-1]
        assert "no known cause explains the hook's result" in diagnosis, case.message[-1500:]
        assert "explained, bit for bit, by" not in diagnosis, case.message[-1500:]


def test_rerun_command_reproduces_exactly_that_case(zoo_run, tmp_path):
    case = next(c for c in zoo_run.by_hook()["bad_wrong_shard"] if c.outcome == "failed")
    rerun = run_suite(rerun_args(case.message), str(tmp_path / "rerun.xml"))
    assert rerun.returncode == 1, rerun.output[-3000:]
    assert [c.name for c in rerun.cases] == [case.name]
    assert rerun.cases[0].outcome == "failed"


def test_lossy_hint_only_where_no_named_cause_explains(zoo_run):
    """A sum without averaging is a named exact cause, not a lossy design: no LossyContract hint. (The
    hint where nothing explains the difference: tests/test_meta_lossy.py, bad_int8_undeclared.)"""
    failed = [c for c in zoo_run.by_hook()["bad_sum_no_average"]
              if c.check in ("averaging", "parity") and c.outcome == "failed"]
    assert failed
    for case in failed:
        assert "explained, bit for bit, by" in case.message, case.message[-1500:]
        assert "LossyContract" not in case.message, case.message[-1500:]
