"""Meta-tests for FSDP2: the suite catches every known-bad comm/hook and passes every known-good one.

One run of the conformance suite (``python -m conformance``, as a user runs it) over the zoo
in ``tests/zoo/fsdp2_comms.py``, judged by its JUnit XML. The run is limited to the
``nested_wrapped`` model, which every config (default, divide factor, forced SUM, both, HSDP)
uses, and to the main world size plus HSDP on a 4-rank pool (``--extra-world-size 4``, which
the default CPU run leaves out; no zoo entry depends on world size 3); the other models and
world size 3 are exercised by the default ``make conform`` run. Plus quick checks,
without a pool, of the pieces the FSDP2 checks are built from.
"""

from __future__ import annotations

import re

import pytest
import torch

from conformance.apis.fsdp2 import plan as checks
from conformance.apis.fsdp2 import build
from conformance.apis.fsdp2 import recorders
from tests.meta_helpers import rerun_args, run_suite
from tests.zoo import fsdp2_comms as zoo

#: The configs (``config`` property) that must catch each known-bad spec; see zoo.EXPECTED_CATCH.
MUST_CATCH = {
    "bad_always_sum": {"default", "hsdp"},
    "bad_self_average": {"force_sum", "divide_factor_force_sum"},
    "bad_self_average_fp16": {"default", "divide_factor", "hsdp"},
    "bad_wrong_shard": {"default", "force_sum", "divide_factor_force_sum", "hsdp"},
    "bad_default_group": {"hsdp", "subgroup"},
    "bad_fp32_alloc_bf16": {"default", "hsdp"},
    "bad_padded_alloc": {"default", "hsdp"},
    "bad_bf16_wire": {"default", "hsdp"},
    "bad_staging_buffer": {"default", "hsdp"},
    "bad_stale_replay": {"default", "hsdp"},
    "bad_rank0_noise": {"default", "hsdp"},
    "bad_world_average_hook": {"hsdp"},
    "bad_replica_divide_hook": {"hsdp"},
}
#: Caught only by hard inputs (NaN, Inf): the check, not the config, is what matters.
MUST_CATCH_BY_CHECK = {"bad_nan_to_zero": {"fsdp2_hard_inputs"},
                       "bad_nan_to_zero_hook": {"fsdp2_all_reduce_hard_inputs"}}
#: Caught only where ReduceOp.PREMUL_SUM runs natively (NCCL); skipped with the reason on gloo.
MUST_CATCH_WITH_PREMUL_SUM = {"bad_premul_as_avg": {"divide_factor"}}


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    junit = str(tmp_path_factory.mktemp("zoo2") / "zoo2.xml")
    run = run_suite(["--hook", "tests.zoo.fsdp2_comms:ALL", "--extra-world-size", "4", "-q",
                     "-k", "fsdp2 and (nested_wrapped or hard_inputs) and (ws2 or hsdp or subgroup)"], junit)
    assert run.cases, f"the suite wrote no JUnit cases; output:\n{run.output[-4000:]}"
    return run


def test_every_bad_spec_has_an_expected_catch():
    bad = {s.name for s in zoo.KNOWN_BAD} | {s.name for s in zoo.NCCL_ONLY_BAD}
    assert bad == set(MUST_CATCH) | set(MUST_CATCH_BY_CHECK) | set(MUST_CATCH_WITH_PREMUL_SUM) == \
        set(zoo.EXPECTED_CATCH)


def test_run_fails_because_of_bad_specs(zoo_run):
    assert zoo_run.returncode == 1, zoo_run.output[-3000:]


@pytest.mark.parametrize("name", [s.name for s in zoo.KNOWN_GOOD])
def test_known_good_passes_every_case(zoo_run, name):
    spec = next(s for s in zoo.KNOWN_GOOD if s.name == name)
    cases = zoo_run.by_hook()[name]
    ran = {c.properties.get("config") for c in cases if c.outcome == "passed"}
    if spec.api == "fsdp2_all_reduce":
        assert ran == {"hsdp"}, [(c.name, c.outcome) for c in cases]
    else:
        want = {"default", "divide_factor_force_sum", "hsdp"}
        if spec.reduce_dtype == torch.float16:
            want.add("divide_factor")  # float16 reduces with SUM: no PREMUL_SUM, runs on gloo too
        assert want <= ran, f"{name} ran only {sorted(ran)}"
    bad = [f"{c.name}: {c.outcome}\n{c.message[:2000]}" for c in cases if c.outcome not in ("passed", "skipped")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MUST_CATCH))
def test_known_bad_is_caught(zoo_run, name):
    cases = zoo_run.by_hook()[name]
    assert cases, f"{name} was not run"
    caught = {c.properties.get("config") for c in cases if c.outcome == "failed"}
    missing = MUST_CATCH[name] - caught
    assert not missing, f"{name} was not caught under {sorted(missing)} (caught under: {sorted(caught)})"
    errors = [c.name for c in cases if c.outcome == "error"]
    assert not errors, f"{name} produced setup/teardown errors instead of verdicts: {errors}"


@pytest.mark.parametrize("name", sorted(MUST_CATCH_BY_CHECK))
def test_known_bad_is_caught_by_its_check(zoo_run, name):
    cases = zoo_run.by_hook()[name]
    caught = {c.check for c in cases if c.outcome == "failed"}
    assert MUST_CATCH_BY_CHECK[name] <= caught, f"{name} was caught only by {sorted(caught)}"
    # Every other check passes it: the class is invisible without hard inputs.
    assert caught == MUST_CATCH_BY_CHECK[name], sorted(caught)


def test_premul_sum_gap_is_reported_not_hidden(zoo_run):
    """gloo cannot run PREMUL_SUM: the divide-factor cases of float32/bfloat16 claims say so as skips."""
    cases = [c for c in zoo_run.cases if "[bad_premul_as_avg-" in c.name]  # skipped cases carry no properties
    divide = [c for c in cases if "-divide_factor-" in c.name]
    assert divide, [c.name for c in cases]
    if all(c.outcome == "skipped" for c in divide):
        assert all("Cannot use ReduceOp.PREMUL_SUM with Gloo" in c.message for c in divide), divide[0].message
        assert not [c.name for c in cases if c.outcome == "failed"]
    else:  # a backend with PREMUL_SUM (NCCL) catches it there
        assert {c.properties.get("config") for c in cases if c.outcome == "failed"} >= \
            MUST_CATCH_WITH_PREMUL_SUM["bad_premul_as_avg"]


def test_default_group_is_caught_only_where_the_group_is_not_world(zoo_run):
    """On a 1-D mesh over the pool the shard group is the default group; HSDP and the subgroup config
    hand the comm another group of more than one rank."""
    cases = zoo_run.by_hook()["bad_default_group"]
    assert {c.properties.get("config") for c in cases if c.outcome == "failed"} == {"hsdp", "subgroup"}
    assert any(c.outcome == "passed" for c in cases)


def test_stale_replay_is_caught_from_the_second_step(zoo_run):
    case = next(c for c in zoo_run.by_hook()["bad_stale_replay"]
                if c.outcome == "failed" and c.properties.get("config") == "default")
    assert ", step 1, parameter '" in case.message and ", step 0" not in case.message, case.message[:2000]


def test_wrong_allocation_dtype_is_named(zoo_run):
    case = next(c for c in zoo_run.by_hook()["bad_fp32_alloc_bf16"] if c.outcome == "failed")
    assert "dtype=bfloat16) returned shape" in case.message and "float32" in case.message, case.message[:2000]


def test_ulps_of_a_reduced_precision_claim_are_counted_in_the_reduce_dtype_too(zoo_run):
    """bfloat16 has float32's exponent range and 16 fewer fraction bits: each figure is the float32 one / 2**16."""
    case = next(c for c in zoo_run.by_hook()["bad_fp32_alloc_bf16"]
                if c.outcome == "failed" and c.properties.get("config") == "default")
    figures = re.findall(r"max ULP diff (\d+) \(float32\), ([0-9.e+-]+) in bfloat16", case.message)
    assert figures, case.message[:3000]
    for in_float32, in_bfloat16 in figures:
        assert float(in_bfloat16) == pytest.approx(int(in_float32) / 2 ** 16, rel=1e-5)


def test_recorder_findings_come_above_a_rank_traceback(zoo_run):
    """The padded buffers make gloo's reduce-scatter raise its size check; the wrong allocation the recorder
    noted before that leads each raising rank's report, above the rank's traceback."""
    case = next(c for c in zoo_run.by_hook()["bad_padded_alloc"]
                if c.properties.get("config") == "default" and c.properties.get("world_size") == "2")
    blocks = re.split(r"^--- (rank \d+): raised .* ---$", case.message, flags=re.MULTILINE)
    raised = dict(zip(blocks[1::2], blocks[2::2]))
    assert raised, case.message[-3000:]
    for rank, text in raised.items():
        found = re.search(rf"\[{rank}, step 0\] comm\.allocate\(size=\((\d+),\), dtype=float32\) returned shape "
                          r"\((\d+),\)", text)
        assert found, f"{rank}: no allocation finding in:\n{text[:3000]}"
        assert int(found[2]) % 64 == 0 and int(found[2]) > int(found[1]), found[0]
        assert text.index(found[0]) < text.index("Traceback (most recent call last)"), text[:3000]


def test_failure_names_everything_needed_to_act(zoo_run):
    """Hook, check, config, model, world size, rank, step, FQN, the op FSDP2 passed, ULP diff, re-run command."""
    case = next(c for c in zoo_run.by_hook()["bad_rank0_noise"]
                if c.properties.get("config") == "default" and c.properties.get("world_size") == "2")
    msg = case.message
    for needle in ("hook bad_rank0_noise does not conform", "check=fsdp2_parity", "config=default",
                   "model=nested_wrapped", "world_size=2", "[rank 0, step 0, parameter '",
                   "differs from native fully_shard", "FSDP2 called the comm with op=", "over a group of 2",
                   "max ULP diff 1", "Re-run just this case:",
                   "-k 'test_fsdp2_parity[bad_rank0_noise-default-nested_wrapped-ws2]'"):
        assert needle in msg, f"{needle!r} missing from:\n{msg}"


def test_rerun_command_reproduces_exactly_that_case(zoo_run, tmp_path):
    case = next(c for c in zoo_run.by_hook()["bad_wrong_shard"]
                if c.outcome == "failed" and c.properties.get("world_size") == "2")
    rerun = run_suite(rerun_args(case.message), str(tmp_path / "rerun.xml"))
    assert rerun.returncode == 1, rerun.output[-3000:]
    assert [c.name for c in rerun.cases] == [case.name]
    assert rerun.cases[0].outcome == "failed"


# -- the building blocks, without a pool ---------------------------------------------------------


def test_divide_factors_follow_fsdp2():
    """Which configs reduce with PREMUL_SUM, as _get_gradient_divide_factors decides."""
    assert checks.uses_premul_sum("divide_factor", None)
    assert checks.uses_premul_sum("divide_factor", torch.bfloat16)
    assert not checks.uses_premul_sum("divide_factor", torch.float16)
    assert not checks.uses_premul_sum("divide_factor_force_sum", None)
    assert not checks.uses_premul_sum("default", None)
    if build.missing_api() is None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

        class _Group:
            def size(self):
                return 2

        pre, post, rs_op, _ = _get_gradient_divide_factors(_Group(), None, torch.float32, "cpu",
                                                           build.divide_factor(2), False)
        assert (pre, post) == (None, None) and "PREMUL_SUM" in recorders.op_name(rs_op)
        pre, post, rs_op, _ = _get_gradient_divide_factors(_Group(), None, torch.float16, "cpu",
                                                           build.divide_factor(2), False)
        assert (pre, post, recorders.op_name(rs_op)) == (2, 2.0, "SUM")


def test_op_names():
    from torch.distributed import ReduceOp

    assert recorders.op_name(ReduceOp.AVG) == "AVG"
    assert recorders.op_name(ReduceOp.SUM) == "SUM"
    assert recorders.op_name(ReduceOp.PREMUL_SUM(0.25)) == "PREMUL_SUM(0.25)"


def test_missing_api_names_the_method_and_torch_version():
    why = build.missing_api(["set_something_from_the_future"])
    if build.fsdp2_api() is None:
        assert "fully_shard" in why
    else:
        assert "FSDPModule.set_something_from_the_future" in why
    assert torch.__version__ in why


@pytest.mark.parametrize("name", ["net_wrapped", "net_flat", "nested_wrapped", "always_wrap_nested",
                                  "transformer_shared", "gradient_probe"])
def test_fully_shard_units_mirror_the_fsdp1_units(name):
    """The FSDP2 build shards the same submodules the FSDP1 build wraps (root included)."""
    from conformance.models import get_model

    cls = get_model(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls._construct(2)
    units = build._unit_modules(model)
    assert len(units) + 1 == cls.fsdp_units
    order = list(model.modules())
    for i, unit in enumerate(units):  # innermost first: no unit contains a later one
        assert all(not any(m is later for m in unit.modules()) for later in units[i + 1:]), name
    assert all(any(u is m for m in order) for u in units)


def test_plain_reduce_scatter_is_the_documented_example():
    from conformance.apis.fsdp2.builtin_hooks import FSDP2_HOOKS, PlainReduceScatter

    assert [s.name for s in FSDP2_HOOKS] == ["plain_reduce_scatter", "plain_reduce_scatter_bf16",
                                             "plain_reduce_scatter_fp16"]
    assert all(s.api == "fsdp2" and s.hook is PlainReduceScatter for s in FSDP2_HOOKS)
    comm = PlainReduceScatter()
    buf = comm.allocate((6,), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert buf.shape == (6,) and buf.dtype == torch.bfloat16
    if build.missing_api(["set_custom_reduce_scatter"]) is None:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        assert isinstance(comm, ReduceScatter)


#: comm -> (check, the diagnosis its failures must carry).
DIAGNOSED = {
    "bad_always_sum": ("fsdp2_parity", "SUM without averaging"),
    "bad_bf16_wire": ("fsdp2_parity", "reduced in bfloat16, where the hook claims no reduce dtype"),
    "bad_stale_replay": ("fsdp2_parity", "the result of step 0 (stale)"),
    "bad_wrong_shard": ("fsdp2_parity", "the reduced shard of rank"),
    "bad_self_average_fp16": ("fsdp2_parity", "SUM, then divided by 2, where FSDP2 asked the comm for op=SUM"),
    "bad_nan_to_zero": ("fsdp2_hard_inputs", "NaN or Inf replaced"),
    "bad_world_average_hook": ("fsdp2_all_reduce_hook", "averaged again over the default group"),
    "bad_replica_divide_hook": ("fsdp2_all_reduce_hook", "divided by 2 after native HSDP had already averaged it"),
}


@pytest.mark.parametrize("name", sorted(DIAGNOSED))
def test_comm_failures_carry_the_named_cause(zoo_run, name):
    """The diagnosis recomputes each cause with the op and group FSDP2 passed the comm."""
    check, cause = DIAGNOSED[name]
    failed = [c for c in zoo_run.by_hook()[name] if c.check == check and c.outcome == "failed"
              and c.properties.get("config") in ("default", "hsdp")]
    assert failed, f"{name} did not fail {check}"
    missing = [c.name for c in failed if cause not in c.message]
    assert not missing, f"{cause!r} missing from {missing}:\n{failed[0].message[-2000:]}"


def test_a_comm_whose_buffer_is_clobbered_later_is_told_the_difference_arose_after_it(zoo_run):
    """The staging-buffer comm reduces right; FSDP2's next module overwrites its output afterwards."""
    failed = [c for c in zoo_run.by_hook()["bad_staging_buffer"] if c.outcome == "failed"
              and c.check == "fsdp2_parity"]
    assert failed and all("what differs arose after the hook returned" in c.message for c in failed)


def test_lossy_hint_only_where_no_named_cause_explains(zoo_run):
    """An always-SUM comm and a bfloat16 wire are named exact causes, not lossy designs: no LossyContract
    hint. (The hint where nothing explains the difference: tests/test_meta_lossy.py, bad_int8_comm_undeclared.)"""
    for hook in ("bad_always_sum", "bad_bf16_wire"):
        failed = [c for c in zoo_run.by_hook()[hook] if c.check == "fsdp2_parity" and c.outcome == "failed"]
        assert failed, hook
        for case in failed:
            assert "explained, bit for bit, by" in case.message, case.message[-1500:]
            assert "LossyContract" not in case.message, case.message[-1500:]
