"""How far a verdict reaches: the meter on the ranks, the case's properties, the hook's extent and its words."""

from __future__ import annotations

import types

import torch

from conformance.reports.reach import note_reach
from conformance.protocol import CaseResult, Case, RankOutcome
from conformance.ranks import reach as meter
from conformance.reports.reach import (Reach, bytes_text, hook_reach, not_checked, not_checked_lines, reach_from_json,
                                       short_reason)
from conformance.reports.results import CaseRecord


def test_the_meter_keeps_the_longest_training_and_the_largest_buffer_of_a_case():
    meter.start()
    for step in range(3):
        meter.saw_step(step)
        meter.saw_buffer(torch.empty(10, dtype=torch.float32))
    meter.saw_buffer(torch.empty(7, dtype=torch.bfloat16))
    meter.saw_buffer("not a tensor")
    assert meter.read() == {"steps": 3, "buffer_bytes": 40, "calls": 5}
    meter.saw_bytes(30)  # a bucket DDP logs for its C++ hook: no tensor seen, no call counted
    meter.saw_bytes(64)
    assert meter.read() == {"steps": 3, "buffer_bytes": 64, "calls": 5}
    meter.start()
    assert meter.read() == {"steps": 0, "buffer_bytes": 0, "calls": 0}


def _request():
    return types.SimpleNamespace(node=types.SimpleNamespace(user_properties=[("nodes", 1)]))


def _result(*reaches):
    return CaseResult(case=Case("ddp.parity", None, {}), world_size=len(reaches),
                      outcomes=tuple(RankOutcome(rank=r, ok=True, reach=m) for r, m in enumerate(reaches)))


def test_a_case_gets_the_largest_reach_over_its_ranks_and_dispatches():
    request = _request()
    note_reach(request, _result({"steps": 2, "buffer_bytes": 100}, {"steps": 2, "buffer_bytes": 300}))
    note_reach(request, _result({"steps": 5, "buffer_bytes": 10}, {"steps": 4, "buffer_bytes": 10}))
    props = dict(request.node.user_properties)
    assert (props["steps"], props["buffer_bytes"], props["nodes"]) == (5, 300, 1)
    note_reach(request, _result({}, {}), real_nodes=2)  # under --listen: torchrun's own layout
    assert dict(request.node.user_properties)["nodes"] == 2


def test_a_case_where_the_hook_was_never_called_reaches_nothing():
    request = _request()
    note_reach(request, _result({"steps": 0, "buffer_bytes": 0}, {}))
    assert "steps" not in dict(request.node.user_properties)


def _record(hook, outcome, steps, size, nodes=1, ws=2):
    return CaseRecord(id=f"x{steps}{size}{nodes}{ws}{outcome}", name="n", outcome=outcome, hook=hook, world_size=ws,
                      nodes=nodes, reach={"steps": steps, "buffer_bytes": size} if steps else None)


def test_a_hook_reaches_what_its_passed_cases_reached_and_no_further():
    records = [_record("h", "passed", 256, 1000), _record("h", "passed", 2, 29 * 2**20, nodes=2, ws=4),
               _record("h", "failed", 2000, 2**31), _record("h", "xfailed", 2000, 2**31),
               _record("h", "skipped", 0, 0, nodes=3), _record("other", "passed", 9999, 2**32)]
    got = hook_reach(records, "h", ("gloo",))
    assert got == Reach(cases=2, steps=256, buffer_bytes=29 * 2**20, world_sizes=(2, 4), nodes=(1, 2),
                        combinations=((256, 1000, 1), (2, 29 * 2**20, 2)), backends=("gloo",))
    assert got.text == ("256 steps on buffers up to 1000 bytes; 2 steps on buffers up to 29 MiB on 2 simulated nodes; "
                        "world sizes 2 and 4; gloo")
    assert got.to_json() == {"cases": 2, "max_steps": 256, "max_buffer_bytes": 29 * 2**20, "world_sizes": [2, 4],
                             "nodes": [1, 2], "combinations": [{"steps": 256, "buffer_bytes": 1000, "nodes": 1},
                                                               {"steps": 2, "buffer_bytes": 29 * 2**20, "nodes": 2}],
                             "backends": ["gloo"], "simulated_nodes": True}
    assert reach_from_json(got.to_json()) == got
    assert hook_reach(records, "nobody") is None
    assert hook_reach([_record("r", "passed", 0, 0)], "r").text == "1 node; world size 2"  # a registration rule


def test_the_reach_names_what_ran_together_never_the_maxima_of_each_axis_alone():
    """Issue 44: a long run on small buffers, a large buffer for two steps and two nodes on small buffers read,
    as maxima, as if 256 steps on 29 MiB across 2 nodes had run; the combinations say what ran in one case."""
    records = [_record("h", "passed", 256, 33 * 1024), _record("h", "passed", 2, 29 * 2**20),
               _record("h", "passed", 4, 33 * 1024, nodes=2, ws=4), _record("h", "passed", 3, 1024),
               _record("h", "passed", 256, 1024, nodes=2, ws=4)]
    got = hook_reach(records, "h", ("gloo",), simulated_nodes=False)
    assert got.combinations == ((256, 33 * 1024, 1), (256, 1024, 2), (4, 33 * 1024, 2), (2, 29 * 2**20, 1))
    assert "256 steps on buffers up to 29 MiB" not in got.text
    assert got.text.startswith("256 steps on buffers up to 33 KiB; 256 steps on buffers up to 1 KiB on 2 nodes; ")
    assert "simulated" not in got.text  # under --listen the nodes are torchrun's own


def test_what_could_not_run_here_is_named_with_its_reason():
    premul = "gloo has no ReduceOp.PREMUL_SUM (RuntimeError: Cannot use it with Gloo): for a float32 reduce dtype"
    records = [_skipped("fsdp2_parity", "divide_factor", "nested_wrapped", premul),
               _skipped("fsdp2_parity", "hsdp_divide_factor", "nested_wrapped", premul),
               _skipped("fsdp2_parity", "divide_factor", "nested_wrapped", premul, ws=3),
               _skipped("fsdp2_parity", "replicate", "nested_wrapped", "ran, and matched, but the hook was never called"),
               _skipped("fsdp2_parity", "replicate", "nested_wrapped", "x", hook="other")]
    assert not_checked(records, "h") == (
        (premul, ("fsdp2_parity[divide_factor]", "fsdp2_parity[hsdp_divide_factor]")),
        ("ran, and matched, but the hook was never called", ("fsdp2_parity[replicate]",)))
    assert list(not_checked_lines(records, "h")) == [
        "not checked here: fsdp2_parity[divide_factor], fsdp2_parity[hsdp_divide_factor] "
        "(gloo has no ReduceOp.PREMUL_SUM)",
        "not checked here: fsdp2_parity[replicate] (ran, and matched, but the hook was never called)"]
    assert short_reason("the suite's reference (parity, no hook) cannot run here with torch 2.13: RuntimeError") == \
        "the suite's reference cannot run here with torch 2.13"


def _skipped(check, variant, model, reason, ws=2, hook="h"):
    return CaseRecord(id=f"{check}{variant}{model}{ws}{hook}", name="n", outcome="skipped", hook=hook, world_size=ws,
                      check=check, variant=variant, model=model, skip_reason=reason)


def test_buffer_sizes_read_in_binary_units():
    assert [bytes_text(n) for n in (96, 1024, 1536, 10236, 25 * 2**20 + 12, 2**30)] == [
        "96 bytes", "1 KiB", "1.5 KiB", "10 KiB", "25 MiB", "1 GiB"]
