"""Meta-tests specific to FSDP1 (``register_comm_hook`` on FullyShardedDataParallel).

They read the FSDP1 zoo's run (``tests/meta_zoos/``: FSDP, one run per session); the shape
every zoo shares is in ``tests/test_meta.py``.
"""

from __future__ import annotations

import pytest

from tests.meta_zoos import FSDP


@pytest.fixture
def zoo_run(zoo_runs):
    return zoo_runs(FSDP)


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


def test_a_result_left_in_the_reduce_dtype_is_told_to_cast_back_to_what_it_got(zoo_run):
    """The fix under the contract finding names the dtype FSDP handed the hook, not LowPrecisionState's."""
    failed = [c for c in zoo_run.by_hook()["bad_no_cast_back"] if c.outcome == "failed"]
    assert failed
    for case in failed:
        assert "fix: cast the result back to the dtype the gradient arrived in, float32, not to " \
               "LowPrecisionState.parameter_type" in case.message, case.message[:2000]
