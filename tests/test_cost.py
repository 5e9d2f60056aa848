"""The suite names what a right hook costs (issue 47): the costly zoo (``tests/zoo/costly_hooks.py``) and two of
PyTorch's own hooks, run as a user runs them, with ``--json`` and ``--max-cost``.

One run at 2 ranks over a few parity cases of each costly hook, ``ddp_fp16_compress_hook``'s parity and
``ddp_powerSGD_hook``'s ``lossy_loss``, under ``--max-cost 1.5``: every hook conforms, each one's ``hooks[].cost``
says what it costs (twice the collectives, twice the bytes in float64, an all-gather where native reduce-scatters,
half the bytes in float16), the verdict block prints it, and the run exits 1 for the hooks over 1.5 alone. A
second run, ``ddp_allreduce_hook`` under ``--max-cost 1.0``, exits 0: native's cost is not over native's.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List

import pytest

from conformance.reports.cost import ratio_text
from tests.meta_helpers import BackgroundJob, run_suite

EXTRA = "good_ddp_extra_all_reduce"
FLOAT64 = "good_ddp_float64_wire"
ALL_GATHER = "good_fsdp2_all_gather_reduce"
FP16 = "ddp_fp16_compress_hook"
POWER_SGD = "ddp_powerSGD_hook"
HOOKS = (EXTRA, FLOAT64, ALL_GATHER, FP16, POWER_SGD)

#: Two DDP parity configs of each DDP hook (one bucket; 21 small buckets and buffers DDP broadcasts), FSDP2's
#: default AVG and its forced SUM (with and without a divide factor), and PowerSGD's lossy_loss, all at 2 ranks.
SELECTION = ("test_ddp_parity and (default-nested_wrapped-ws2 or small_buckets-transformer_shared-ws2) "
             f"and (good_ddp_ or {FP16}-) "
             f"or test_fsdp2_parity and {ALL_GATHER} and (default-nested_wrapped-ws2 or force_sum-nested_wrapped-ws2) "
             f"or test_ddp_lossy_loss and {POWER_SGD}-")
#: The kinds a reduce-scatter may be recorded as (gloo's recorder names FSDP2's reduce-scatter ``all_reduce``).
REDUCING = ("reduce_scatter", "all_reduce")


def _run(args: List[str], directory: str, env: Dict[str, str]) -> Dict[str, Any]:
    json_path = os.path.join(directory, "cost.json")
    run = run_suite([*args, "--json", json_path], os.path.join(directory, "cost.xml"), env=env, timeout=600)
    doc = None
    if os.path.exists(json_path):
        with open(json_path) as f:
            doc = json.load(f)
    return {"run": run, "doc": doc}


def _costly_run(runs, directory, env):
    return _run(["--hook", "tests.zoo.costly_hooks:KNOWN_GOOD",
                 "--hook", "conformance.apis.ddp.builtin_hooks:DDP_HOOKS",
                 "-k", SELECTION, "--max-cost", "1.5"], directory, env)


def _allreduce_run(runs, directory, env):
    return _run(["--hook", "conformance.apis.ddp.builtin_hooks:DDP_HOOKS",
                 "-k", "test_ddp_parity and ddp_allreduce_hook-default-nested_wrapped-ws2", "--max-cost", "1.0"],
                directory, env)


#: The runs, in the zoo runs' background threads (``tests/conftest.py``).
COSTLY_RUN = BackgroundJob("cost_run", _costly_run)
ALLREDUCE_RUN = BackgroundJob("cost_allreduce_run", _allreduce_run)


@pytest.fixture(scope="module")
def costly(zoo_runs):
    got = zoo_runs(COSTLY_RUN)
    assert got["doc"] is not None, f"the run wrote no JSON; output:\n{got['run'].output[-4000:]}"
    return got["run"], got["doc"]


def _hook(doc, name):
    return next(h for h in doc["hooks"] if h["name"] == name)


def _cases(doc, name):
    cases = [c for c in doc["cases"] if c["hook"] == name]
    assert cases, f"no case of {name} ran"
    return cases


def _verdict_block(output: str, hook: str) -> List[str]:
    """The verdict line of ``hook`` and the indented lines under it."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(hook)}\s+(CONFORMS|DOES NOT)", line)),
                 None)
    assert start is not None, f"no verdict line for {hook}:\n{output[-4000:]}"
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        block.append(line)
    return block


def test_every_costly_hook_conforms_and_each_case_was_measured(costly):
    run, doc = costly
    for hook in HOOKS:
        assert _hook(doc, hook)["status"] == "conforms", (hook, _hook(doc, hook)["verdict"])
        for case in _cases(doc, hook):
            assert case["outcome"] == "passed", (case["name"], case.get("message", "")[-2000:])
            cost = case["cost"]
            assert "not_measured" not in cost, (case["name"], cost)
            assert cost["warm"] and cost["ranks"] == 2, (case["name"], cost)
    assert doc["run"]["counts"].get("passed") == len(doc["cases"]), doc["run"]["counts"]


def test_an_extra_all_reduce_per_bucket_is_named_as_more_collectives(costly):
    _, doc = costly
    cost = _hook(doc, EXTRA)["cost"]
    assert cost["collectives_ratio"] > 1.5, cost
    assert 1.0 <= cost["bytes_ratio"] < 1.01, cost  # the flag is 4 bytes a bucket
    for case in _cases(doc, EXTRA):
        native, hooked = case["cost"]["native"], case["cost"]["hooked"]
        assert hooked["by_kind"]["all_reduce"] == 2 * native["by_kind"]["all_reduce"], (case["name"], case["cost"])


def test_a_float64_wire_is_named_as_twice_the_bytes(costly):
    _, doc = costly
    cost = _hook(doc, FLOAT64)["cost"]
    assert cost["bytes_ratio"] >= 1.9, cost
    assert cost["collectives_ratio"] == 1.0, cost
    assert cost["wire_dtypes"][0] == "float64", cost
    assert "float64" not in cost["native_wire_dtypes"], cost
    for case in _cases(doc, FLOAT64):
        native, hooked = case["cost"]["native"], case["cost"]["hooked"]
        # Each bucket's float32 goes as float64: twice its bytes; the float32 left is the buffers DDP broadcasts.
        moved = native["bytes_by_dtype"]["float32"] - hooked["bytes_by_dtype"].get("float32", 0)
        assert hooked["bytes_by_dtype"]["float64"] == 2 * moved, (case["name"], case["cost"])


def test_an_all_gather_in_place_of_a_reduce_scatter_is_named_by_its_kind(costly):
    """A collective moves the larger of its input and its output: a reduce-scatter the full flat gradient, the
    comm's all-gather every rank's full flat gradient (the group's size times more). So the collectives are
    native's, the bytes more, and the kind named. FSDP2's own parameter all-gathers are in both models' steps, so
    native has all-gathers too."""
    _, doc = costly
    cost = _hook(doc, ALL_GATHER)["cost"]
    assert cost["collectives_ratio"] == 1.0 and cost["bytes_ratio"] > 1.2, cost
    for case in _cases(doc, ALL_GATHER):
        assert case["cost"]["hooked"]["bytes"] > case["cost"]["native"]["bytes"], (case["name"], case["cost"])
    assert cost["hooked"]["by_kind"]["all_gather"] > cost["native"]["by_kind"].get("all_gather", 0), cost
    for case in _cases(doc, ALL_GATHER):
        native, hooked = case["cost"]["native"]["by_kind"], case["cost"]["hooked"]["by_kind"]
        reduced = sum(native.get(kind, 0) for kind in REDUCING)
        assert reduced > 0, (case["name"], case["cost"])
        assert not any(hooked.get(kind) for kind in REDUCING), (case["name"], case["cost"])
        assert hooked["all_gather"] == native.get("all_gather", 0) + reduced, (case["name"], case["cost"])


def test_fp16_compression_is_named_as_half_the_bytes_against_full_precision(costly):
    """Native of a float16 claim sends float16 too; the suite holds the hook against float32 native instead
    (``rescaled_from``), so the float16 bytes are the same on both sides and the ratio is about a half (the
    buffers DDP broadcasts in float32 and int64 are not compressed)."""
    _, doc = costly
    cost = _hook(doc, FP16)["cost"]
    assert 0.49 <= cost["bytes_ratio"] <= 0.53, cost
    assert cost["collectives_ratio"] == 1.0, cost
    assert cost["wire_dtypes"][0] == "float16", cost
    for case in _cases(doc, FP16):
        native, hooked = case["cost"]["native"], case["cost"]["hooked"]
        assert hooked["bytes_by_dtype"]["float16"] == native["rescaled_from"]["float16"], (case["name"], case["cost"])
        assert "float16" not in native["bytes_by_dtype"], (case["name"], case["cost"])


def test_power_sgd_is_named_as_more_collectives_and_fewer_bytes(costly):
    _, doc = costly
    cost = _hook(doc, POWER_SGD)["cost"]
    assert cost["collectives_ratio"] > 1.0 and cost["bytes_ratio"] < 0.5, cost


def test_the_verdict_block_prints_each_hooks_cost(costly):
    run, doc = costly
    for hook in HOOKS:
        cost = _hook(doc, hook)["cost"]
        block = _verdict_block(run.output, hook)
        lines = [line.strip() for line in block if line.strip().startswith("cost vs native:")]
        assert len(lines) == 1, "\n".join(block)
        assert lines[0].startswith(f"cost vs native: {ratio_text(cost['collectives_ratio'])} collectives, "
                                   f"{ratio_text(cost['bytes_ratio'])} bytes"), lines[0]
        assert f"per step over {cost['cases']} case(s)" in lines[0], lines[0]
    assert any("2.0x bytes (float64" in line for line in _verdict_block(run.output, FLOAT64))
    assert any("0.50x bytes (float16" in line for line in _verdict_block(run.output, FP16))


def test_max_cost_fails_the_run_for_the_hooks_over_it_alone(costly):
    run, doc = costly
    assert run.returncode == 1, run.output[-4000:]
    assert doc["run"]["exit_status"] == 1
    section = run.output.split("cost over --max-cost", 1)
    assert len(section) == 2, run.output[-4000:]
    over = section[1]
    assert re.search(rf"^{EXTRA}: [\d.]+x collectives of native's$", over, re.M), over
    assert re.search(rf"^{FLOAT64}: [\d.]+x bytes of native's$", over, re.M), over
    for hook in (ALL_GATHER, FP16):
        assert not re.search(rf"^{hook}:", over, re.M), over
    assert "--max-cost 1.5: exit status 1" in over, over


def test_native_cost_is_not_over_max_cost_one(zoo_runs):
    got = zoo_runs(ALLREDUCE_RUN)
    run, doc = got["run"], got["doc"]
    assert run.returncode == 0, run.output[-4000:]
    cost = _hook(doc, "ddp_allreduce_hook")["cost"]
    assert (cost["collectives_ratio"], cost["bytes_ratio"]) == (1.0, 1.0), cost
    assert "cost over --max-cost" not in run.output, run.output[-4000:]


def test_a_cost_grown_since_the_baseline_is_a_regression(costly, tmp_path):
    """The baseline remembers each hook's cost: against a baseline where the extra all-reduce's hook cost what native
    does, its run now is a cost regression, which ``--fail-on regressions`` fails (every case passes)."""
    _, doc = costly
    then = json.loads(json.dumps(doc))
    entry = _hook(then, EXTRA)
    entry["cost"]["hooked"] = dict(entry["cost"]["native"])  # as cheap as native, then
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(then))
    json_path = str(tmp_path / "now.json")
    run = run_suite(["--hook", "tests.zoo.costly_hooks:KNOWN_GOOD", "-k",
                     f"test_ddp_parity and {EXTRA}-default-nested_wrapped-ws2", "--baseline", str(baseline),
                     "--fail-on", "regressions", "--json", json_path], str(tmp_path / "now.xml"), timeout=600)
    assert run.returncode == 1, run.output[-4000:]
    assert re.search(rf"^  {EXTRA}: collectives 1\.0x -> [\d.]+x of native's$", run.output, re.M), run.output[-4000:]
    with open(json_path) as f:
        now = json.load(f)
    regressions = now["baseline"]["cost_regressions"]
    assert [(r["hook"], r["figure"]) for r in regressions] == [(EXTRA, "collectives")], regressions
    assert now["baseline"]["new_failures"] == [], now["baseline"]
