"""Meta-tests specific to FSDP2 (fully_shard's custom reduce-scatter and all-reduce hooks).

They read the FSDP2 zoo's run (``tests/meta_zoos/``: FSDP2, one run per session, limited to
``nested_wrapped``, the main world size and HSDP on a 4-rank pool); the shape every zoo shares
is in ``tests/test_meta.py``. Plus quick checks, without a pool, of the pieces the FSDP2
checks are built from.
"""

from __future__ import annotations

import re

import pytest
import torch

from conformance.apis.fsdp2 import plan as checks
from conformance.apis.fsdp2 import recorder as recorders
from conformance.apis.fsdp2_common import build, setup, standalone
from tests.meta_helpers import run_suite
from tests.meta_zoos import FSDP2, FSDP2_MUST_CATCH_WITH_PREMUL_SUM, NATIVE_MODES
from tests.zoo import fsdp2_comms as zoo

@pytest.fixture
def zoo_run(zoo_runs):
    return zoo_runs(FSDP2)


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
            FSDP2_MUST_CATCH_WITH_PREMUL_SUM["bad_premul_as_avg"]


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
                                                           setup.divide_factor(2), False)
        assert (pre, post) == (None, None) and "PREMUL_SUM" in recorders.op_name(rs_op)
        pre, post, rs_op, _ = _get_gradient_divide_factors(_Group(), None, torch.float16, "cpu",
                                                           setup.divide_factor(2), False)
        assert (pre, post, recorders.op_name(rs_op)) == (2, 2.0, "SUM")


def test_op_names():
    from torch.distributed import ReduceOp

    assert recorders.op_name(ReduceOp.AVG) == "AVG"
    assert recorders.op_name(ReduceOp.SUM) == "SUM"
    assert recorders.op_name(ReduceOp.PREMUL_SUM(0.25)) == "PREMUL_SUM(0.25)"


def test_missing_api_names_the_method_and_torch_version():
    why = build.missing_api(["set_something_from_the_future"])
    if standalone.fsdp2_api() is None:
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
    units = standalone._unit_modules(cls, model)
    assert len(units) + 1 == cls.fsdp_units
    order = list(model.modules())
    for i, unit in enumerate(units):  # innermost first: no unit contains a later one
        assert all(not any(m is later for m in unit.modules()) for later in units[i + 1:]), name
    assert all(any(u is m for m in order) for u in units)


def test_plain_reduce_scatter_is_the_documented_example():
    from conformance.apis.fsdp2.builtin_hooks import FSDP2_HOOKS, PlainReduceScatter

    assert [s.name for s in FSDP2_HOOKS] == ["plain_reduce_scatter", "plain_reduce_scatter_bf16",
                                             "plain_reduce_scatter_fp16", "plain_reduce_scatter_params_bf16"]
    assert all(s.api == "fsdp2" and s.hook is PlainReduceScatter for s in FSDP2_HOOKS)
    comm = PlainReduceScatter()
    buf = comm.allocate((6,), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert buf.shape == (6,) and buf.dtype == torch.bfloat16
    if build.missing_api(["set_custom_reduce_scatter"]) is None:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        assert isinstance(comm, ReduceScatter)


def test_a_comm_whose_buffer_is_clobbered_later_is_told_the_difference_arose_after_it(zoo_run):
    """The staging-buffer comm reduces right; FSDP2's next module overwrites its output afterwards."""
    failed = [c for c in zoo_run.by_hook()["bad_staging_buffer"] if c.outcome == "failed"
              and c.check == "fsdp2_parity"]
    assert failed and all("what differs arose after the hook returned" in c.message for c in failed)




def test_no_bad_comm_is_told_to_declare_itself_lossy(zoo_run):
    """Every bad spec of this zoo claims exactness and is wrong for a reason the suite names (a divisor, a shard,
    a dtype, a buffer): none of its failures may offer the LossyContract hint. (The lossy-by-design specs that
    do get it are in the lossy zoo, tests/test_meta_lossy.py.)"""
    hinted = {c.hook for c in zoo_run.cases if c.outcome == "failed" and "LossyContract" in c.message}
    exact_bad = {s.name for s in zoo.KNOWN_BAD + zoo.NCCL_ONLY_BAD if s.lossy is None}
    assert not hinted & exact_bad, sorted(hinted & exact_bad)


def test_a_comm_under_replicate_is_told_it_is_never_called(zoo_run):
    """``replicate`` on FSDP2 has no shard group: FSDP2 calls the comm's ``allocate`` there but never the comm.
    The case runs, matches replicate without the comm, and is skipped with that finding as its reason: never a
    pass, never a failure of a right comm (issue 17)."""
    case = next(c for c in zoo_run.cases if c.name == "test_fsdp2_parity[good_async_wait-replicate-nested_wrapped-ws2]")
    assert case.outcome == "skipped", (case.outcome, case.message[:2000])
    assert "ran, and matched, but the hook was never called: this comm is never called under replicate" \
        in case.message, case.message[:2000]


#: The cases of the comms only 3 ranks catch (``fsdp2_comms.THREE_RANK_BAD``): parity at 2 and 3 ranks, and the
#: 3-rank hard inputs.
_THREE_RANK_CASES = ("(test_fsdp2_parity and default-nested_wrapped and (ws2 or ws3) and not 2nodes) "
                     "or (test_fsdp2_hard_inputs and gradient_probe and ws3)")


@pytest.mark.timeout(600)
def test_a_comm_exact_at_two_ranks_is_caught_at_three_and_named_by_its_own_arithmetic(tmp_path):
    """The all-to-all comm sums in rank order, then multiplies by 1/world size: native at 2 ranks, caught at 3,
    where the diagnosis names that arithmetic (and its fix) in every failure, parity and hard inputs alike."""
    assert {s.name for s in zoo.THREE_RANK_BAD} == set(zoo.THREE_RANK_EXPECTED)
    run = run_suite(["--hook", "tests.zoo.fsdp2_comms:THREE_RANK_BAD", "--extra-world-size", "3", "-q",
                     "--hypothesis-examples", "2", "-k", _THREE_RANK_CASES], str(tmp_path / "three.xml"), timeout=540)
    cases = {c.name: c for c in run.cases}
    assert cases["test_fsdp2_parity[bad_all_to_all_mean-default-nested_wrapped-ws2]"].outcome == "passed", run.output
    failed = [c for c in cases.values() if c.properties.get("world_size") == "3"]
    assert {c.check for c in failed} == {"fsdp2_parity", "fsdp2_hard_inputs"}, run.output[-3000:]
    own = ("summed in rank order (rank 0 + rank 1 + rank 2), then multiplied by 1/3, where FSDP2 asked the comm "
           "for op=AVG over 3 ranks")
    fix = "reduce with dist.reduce_scatter_tensor itself, not a sum of every rank's values in rank order"
    for case in failed:
        assert case.outcome == "failed", (case.name, case.outcome, case.message[-2000:])
        assert own in case.message and fix in case.message, case.message[-3000:]
        assert "LossyContract" not in case.message, case.message[-3000:]


def test_a_comm_meant_for_fsdp2s_sum_native_runs_its_cases_there_and_says_why_for_the_rest(zoo_runs):
    """FSDP2's ``sum_no_divide`` native (issue 45): a comm written for ``set_gradient_divide_factor(1.0)`` and
    ``set_force_sum_reduction_for_comms(True)`` (one that accepts only SUM raises on FSDP2's AVG) has each of its
    default cases run in that config instead, the same model and world size, and every other config skipped with
    the reason; the same comm claiming both natives fails the default config."""
    run = zoo_runs(NATIVE_MODES)

    def cases(hook, outcome):
        return [c for c in run.cases if c.name.startswith(f"test_fsdp2_parity[{hook}-") and c.outcome == outcome]

    for hook in ("good_sum_only_comm", "good_always_sum_sum_native"):
        passed = [c.name for c in cases(hook, "passed")]
        assert f"test_fsdp2_parity[{hook}-sum_no_divide-mixture_of_experts-ws2]" in passed, passed
        assert f"test_fsdp2_parity[{hook}-sum_no_divide-gradient_probe-ws3]" in passed, passed
        assert all("-sum_no_divide-" in name for name in passed) and not cases(hook, "failed")
        skipped = cases(hook, "skipped")
        assert any("meant for FSDP2's sum_no_divide native only" in c.message for c in skipped)
        assert all("meant for FSDP2's sum_no_divide native only" in c.message or "PREMUL_SUM" in c.message
                   for c in skipped), [c.message[:200] for c in skipped]
        assert not any("-default-" in c.name for c in run.cases if c.name.startswith(f"test_fsdp2_parity[{hook}-"))
    alone = "good_accumulation_only_comm"
    ran = [c.name for c in run.cases if c.name.startswith("test_fsdp2_") and f"[{alone}-" in c.name
           and c.outcome == "passed"]
    assert ran and all(name.startswith("test_fsdp2_accumulation[") for name in ran), ran
    assert all("gradient accumulation only" in c.message for c in run.cases
               if c.name.startswith(f"test_fsdp2_parity[{alone}-") and "PREMUL_SUM" not in c.message)
    assert re.search(r"^good_sum_only_comm +CONFORMS +\[.*; native sum_no_divide\]$", run.output, re.MULTILINE), \
        run.output[-3000:]  # the verdict names the native the hook was held to
    bad = "bad_always_sum_in_default_native"
    assert any("-default-" in c.name for c in cases(bad, "failed"))
    assert {c.name for c in cases(bad, "passed")} >= {f"test_fsdp2_parity[{bad}-sum_no_divide-nested_wrapped-ws2]",
                                                       f"test_fsdp2_parity[{bad}-sum_no_divide-gradient_probe-ws3]"}
