"""The cost meter (issue 47): what it counts from the flight recorder, how a case's and a hook's figures are made,
the gate and the baseline; and that measuring changes no bit of training."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import time
import types

import pytest
import torch

from conformance.ranks import cost
from conformance.reports import cost as report_cost
from conformance.reports.results import CaseRecord


@pytest.mark.parametrize("name, kind", [
    ("gloo:all_reduce", "all_reduce"), ("nccl:allreduce", "all_reduce"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"), ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"),
    ("gloo:all_gather", "all_gather"), ("nccl:_allgather_base", "all_gather"),
    ("nccl:all_gather_into_tensor_coalesced", "all_gather"), ("gloo:broadcast", "broadcast"),
    ("nccl:send 0->1", "point_to_point"), ("nccl:recv 1<-0", "point_to_point"), ("gloo:alltoall_base", "all_to_all"),
    ("gloo:barrier", "barrier"), ("gloo:reduce", "reduce"), ("gloo:something_new", "something_new")])
def test_a_collective_s_kind_comes_from_the_recorder_s_profiling_name(name, kind):
    assert cost.kind_of(name) == kind


def _entry(name, sizes, dtypes, t, record_id=0, out_sizes=None):
    return {"profiling_name": name, "input_sizes": sizes, "input_dtypes": dtypes, "time_created_ns": t,
            "record_id": record_id, "output_sizes": sizes if out_sizes is None else out_sizes,
            "output_dtypes": dtypes if out_sizes is None else dtypes[:1] * len(out_sizes)}


def test_summarise_counts_the_bytes_each_collective_moves_by_dtype_and_rescales_a_reduced_claim_s_reference():
    entries = [_entry("gloo:all_reduce", [[10, 3]], ["Half"], 1), _entry("gloo:broadcast", [[5]], ["Int"], 2),
               _entry("gloo:all_gather", [[4]], ["Float"], 3, out_sizes=[[4], [4], [4]]),
               _entry("nccl:_reduce_scatter_base", [[12]], ["Float"], 4, out_sizes=[[4]])]
    plain = cost.summarise(entries)
    # an all-gather moves the whole result it assembles (3 shards), a reduce-scatter the whole tensor it reduces
    assert plain == {"collectives": 4, "by_kind": {"all_reduce": 1, "broadcast": 1, "all_gather": 1,
                                                   "reduce_scatter": 1},
                     "elements": 30 + 5 + 12 + 12, "bytes": 60 + 20 + 48 + 48,
                     "bytes_by_dtype": {"float16": 60, "int32": 20, "float32": 96}}
    rescaled = cost.summarise(entries, ("float16",))
    assert rescaled["bytes_by_dtype"] == {"float32": 120 + 96, "int32": 20}
    assert rescaled["rescaled_from"] == {"float16": 60}
    assert rescaled["elements"] == plain["elements"] and rescaled["collectives"] == 4


def test_the_ring_is_sized_for_the_ranks_unless_the_user_sized_it():
    assert cost.ring_defaults({}, "2.13.0+cpu") == {"TORCH_FR_BUFFER_SIZE": str(cost.RING_ENTRIES)}
    assert cost.ring_defaults({}, "2.4.1") == {name: str(cost.RING_ENTRIES) for name in cost.RING_VARIABLES}
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "5000"}
    assert cost.ring_defaults(mine) == {} and mine == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "5000"}


def _fake_c10d(monkeypatch, gloo_entries, nccl_entries=None):
    fake = types.SimpleNamespace(_dump_fr_trace=lambda *a: pickle.dumps({"entries": gloo_entries}))
    if nccl_entries is not None:
        fake._dump_nccl_trace = lambda *a: pickle.dumps({"entries": nccl_entries})
    monkeypatch.setattr(torch._C, "_distributed_c10d", fake, raising=False)


def _windows(*bounds):
    for side, step, begin, end in bounds:
        cost._WINDOWS.append({"side": side, "step": step, "begin": begin, "end": end, "events": None,
                              "full_precision": ()})


def test_both_recorders_are_read_and_each_window_gets_the_entries_created_inside_it(monkeypatch):
    """gloo's recorder and NCCL's (where the build has one) are both read; the last step of both sides wins."""
    _fake_c10d(monkeypatch, [_entry("gloo:all_reduce", [[8]], ["Float"], 15), _entry("gloo:all_reduce", [[8]],
                                                                                       ["Float"], 35)],
               [_entry("nccl:all_reduce", [[8]], ["Half"], 36), _entry("nccl:all_reduce", [[2]], ["Float"], 50)])
    cost.start()
    _windows(("native", 0, 10, 20), ("native", 1, 30, 34), ("hooked", 1, 35, 40))
    got = cost.read()
    assert got["step"] == 1 and got["warm"]
    assert got["native"]["collectives"] == 0  # the step-1 native window [30, 34] holds nothing
    assert got["hooked"]["collectives"] == 2 and got["hooked"]["bytes_by_dtype"] == {"float32": 32, "float16": 16}
    assert got["meter_ms"] >= 0


def test_the_suite_s_own_collectives_inside_a_step_are_not_the_hook_s(monkeypatch):
    """A recorder's check of a call (the all-gather recorder gathers every rank's shard) runs inside the hooked
    step: its entries, on this thread inside :func:`cost.suite_own`, are left out; another thread's are not."""
    import threading
    cost.start()
    before = time.time_ns()
    with cost.suite_own():
        inside = time.time_ns()
    me, other = str(threading.get_ident()), "1"
    entries = [_entry("gloo:all_gather", [[4]], ["Float"], inside), _entry("gloo:all_reduce", [[4]], ["Float"], inside)]
    entries[0]["thread_id"], entries[1]["thread_id"] = me, other
    _fake_c10d(monkeypatch, entries)
    _windows(("native", 0, before, before + 1), ("hooked", 0, before, time.time_ns()))
    assert cost.read()["hooked"]["by_kind"] == {"all_reduce": 1}


def test_a_window_the_ring_no_longer_holds_is_not_measured_never_zero(monkeypatch):
    _fake_c10d(monkeypatch, [_entry("gloo:all_reduce", [[8]], ["Float"], 100, record_id=900)])
    cost.start()
    _windows(("native", 2, 10, 20), ("hooked", 2, 90, 120))
    assert "more collectives than the flight recorder's ring holds" in cost.read()["not_measured"]


def test_a_torch_without_a_flight_recorder_says_so(monkeypatch):
    monkeypatch.setattr(torch._C, "_distributed_c10d", types.SimpleNamespace(), raising=False)
    cost.start()
    _windows(("native", 0, 1, 2), ("hooked", 0, 3, 4))
    assert "has no flight recorder" in cost.read()["not_measured"]


def test_a_recorder_that_recorded_nothing_is_off_not_a_free_step(monkeypatch):
    _fake_c10d(monkeypatch, [])
    cost.start()
    _windows(("native", 0, 1, 2), ("hooked", 0, 3, 4))
    assert "recorded nothing" in cost.read()["not_measured"]


def test_a_check_that_trains_one_model_has_no_cost():
    cost.start()
    _windows(("hooked", 0, 1, 2))
    assert cost.read() == {}


def _side(collectives, fp32=0, fp16=0, kinds=None):
    by_dtype = {k: v for k, v in (("float32", fp32), ("float16", fp16)) if v}
    return {"collectives": collectives, "bytes": fp32 + fp16, "elements": fp32 // 4 + fp16 // 2,
            "by_kind": kinds or {"all_reduce": collectives}, "bytes_by_dtype": by_dtype}


def test_a_case_s_cost_is_the_mean_per_rank_and_a_rank_that_lost_its_window_makes_it_not_measured():
    a = {"step": 2, "warm": True, "native": _side(2, fp32=400), "hooked": _side(2, fp16=200), "meter_ms": 1.0}
    b = {"step": 2, "warm": True, "native": _side(2, fp32=400), "hooked": _side(4, fp16=300), "meter_ms": 3.0}
    case = report_cost.combine_ranks([a, b])
    assert case["hooked"]["collectives"] == 3 and case["hooked"]["bytes"] == 250 and case["meter_ms"] == 3.0
    assert report_cost.combine_ranks([a, {"not_measured": "why"}]) == {"not_measured": "why"}
    assert report_cost.combine_ranks([{}, {}]) == {}


def _record(hook, c, outcome="passed"):
    r = CaseRecord(id=f"t::{hook}-{id(c)}", name="t", outcome=outcome, hook=hook)
    r.cost = c
    return r


def test_a_hook_s_cost_sums_its_cases_on_both_sides_and_names_its_wire():
    c1 = report_cost.combine_ranks([{"step": 2, "warm": True, "native": _side(1, fp32=400),
                                     "hooked": _side(2, fp16=200)}])
    c2 = report_cost.combine_ranks([{"step": 0, "warm": False, "native": _side(1, fp32=400),
                                     "hooked": _side(2, fp16=200)}])
    records = [_record("h", c1), _record("h", c2, "failed"), _record("h", {"not_measured": "ring"}),
               _record("other", c1), _record("h", c1, "skipped")]
    hc = report_cost.hook_cost(records, "h")
    assert (hc.cases, hc.warm, hc.ratio("collectives"), hc.ratio("bytes")) == (2, 1, 2.0, 0.5)
    assert hc.text == ("cost vs native: 2.0x collectives, 0.50x bytes (float16 on the wire; native float32); per "
                       "step over 2 case(s), 1 of them at step 0 only; 1 case(s) not measured (ring)")
    assert report_cost.cost_from_json(hc.to_json()) == hc
    assert report_cost.over_max(hc, 1.5) == ["2.0x collectives"] and report_cost.over_max(hc, 2.0) == []
    assert report_cost.hook_cost(records, "nobody") is None
    lost = report_cost.hook_cost([_record("h", {"not_measured": "ring of 0"})], "h")
    assert lost.ratio("bytes") is None and report_cost.over_max(lost, 0.1) == []
    assert lost.text == "cost vs native: not measured in any of its 1 case(s) (ring of 0)"
    table = report_cost.cost_table([{"name": "h", "cost": hc.to_json()}])
    assert table[2].startswith("| `h` | 2.0x | 0.50x |")


@pytest.mark.parametrize("r, text", [(1.0, "1.0x"), (0.5, "0.50x"), (12.4, "12x"), (0.0314, "0.031x"), (None, "n/a")])
def test_ratio_text(r, text):
    assert report_cost.ratio_text(r) == text


def test_a_ratio_grown_since_the_baseline_is_a_cost_regression():
    now = report_cost.Cost(cases=1, warm=1, native=_side(1, fp32=400), hooked=_side(2, fp32=404))
    then = report_cost.Cost(cases=1, warm=1, native=_side(1, fp32=400), hooked=_side(1, fp32=400))
    baseline = {"hooks": [{"name": "h", "cost": then.to_json()}, {"name": "g", "cost": None}]}
    got = report_cost.cost_regressions(baseline, {"h": now, "g": now, "new": now})
    assert [(c.hook, c.figure) for c in got] == [("h", "collectives")]  # bytes grew 1 %, within the tolerance
    assert got[0].text() == "h: collectives 1.0x -> 2.0x of native's"


# -- on real ranks: the meter changes no bit ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank, port, measure, queue):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cost.ring_defaults(os.environ)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    ref, hooked = (DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))) for _ in range(2))
    hooked.load_state_dict(ref.state_dict())
    hooked.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    ref.register_comm_hook(None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, hooked)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    cost.start()
    for step in range(4):
        for side, model, opt in (("native", ref, opts[0]), ("hooked", hooked, opts[1])):
            opt.zero_grad()
            if measure:
                with cost.measured(side, step, full_precision=(torch.float16,) if side == "native" else ()):
                    model(x).square().sum().backward()
            else:
                model(x).square().sum().backward()
            opt.step()
    # plain pickle: the tensors by value (a multiprocessing queue would pass their storage as file descriptors)
    queue.put(pickle.dumps((rank, [p.detach().clone() for p in hooked.parameters()], cost.read())))
    dist.destroy_process_group()


def _run(measure):
    # spawned, not forked: make test forks nothing from its own process, whose background runs hold threads
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_train, args=(r, port, measure, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 300
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            r, params, c = pickle.loads(queue.get(timeout=5))
            got[r] = (params, c)
        except Exception:  # noqa: BLE001 - queue.Empty: see whether a rank died
            assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, [p.exitcode for p in procs]
    assert len(got) == len(procs)
    return got


@pytest.mark.ranks
def test_measuring_changes_no_bit_and_counts_fp16_compress_at_half_native_s_gradient_bytes():
    with_meter, without = _run(True), _run(False)
    for rank in (0, 1):
        for a, b in zip(with_meter[rank][0], without[rank][0]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        measured = with_meter[rank][1]
        assert measured["step"] == 2 and without[rank][1] == {}
        native, hooked = measured["native"], measured["hooked"]
        assert hooked["by_kind"] == native["by_kind"] == {"all_reduce": 1}  # step 2: past DDP's bucket rebuild
        assert hooked["bytes_by_dtype"] == {"float16": 16 * 32 * 2 + 32 * 2 + 32 * 4 * 2 + 4 * 2}
        assert native["bytes"] == 2 * hooked["bytes"] and native["rescaled_from"] == hooked["bytes_by_dtype"]
