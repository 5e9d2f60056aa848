"""Four FSDP2 setters against a custom comm: which change what the comm is handed, on 2 gloo ranks (CPU).

``FSDPModule.set_reduce_scatter_max_input_buffers``, ``set_separate_reduce_scatter_group``,
``set_allocate_memory_from_process_group_for_comm`` and ``set_symm_mem_for_comm`` each touch the comms FSDP2
calls. A setter that does not change what a custom comm (``set_custom_reduce_scatter``,
``set_custom_all_gather``) is handed needs no configuration of its own in the suite; one that does, or that cannot
be combined with a custom comm at all, has to be said so. Each test here shows which, against torch itself.

How it runs: one pair of ranks (``torch.multiprocessing`` spawn, gloo over a ``FileStore`` as the other ``ranks``
tests do) runs every scenario once for the whole module (:func:`measured`): a fixed-seed
``Sequential(Linear(8, 16), ReLU, Linear(16, 4))``, ``fully_shard`` on each ``Linear`` and the root, 2 SGD steps
on the same rank-dependent inputs, with recording comms installed on both ``Linear`` units. Each recording comm
notes per call the input's bits (a clone), shapes, dtype, op, ``async_op`` and the group's ranks, then runs the
native collective so training goes on. Each rank saves what it saw; the tests compare it here, call by call and
bit for bit. The root holds no parameter of its own, so it has no parameter group: a setter that is not recursive
(the allocation and symmetric-memory ones, and ``set_custom_*``) is called on every FSDP unit.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError as error:  # torch before FSDP2's public fully_shard or its custom comm API
    pytest.skip(f"torch {torch.__version__} has no FSDP2 custom comm API ({error})", allow_module_level=True)
if not hasattr(FSDPModule, "set_custom_reduce_scatter") or not hasattr(FSDPModule, "set_custom_all_gather"):
    pytest.skip(f"torch {torch.__version__}: FSDPModule has no set_custom_reduce_scatter/set_custom_all_gather",
                allow_module_level=True)

WORLD_SIZE = 2
STEPS = 2
MAX_BUFFERS = "set_reduce_scatter_max_input_buffers"
SEPARATE_GROUP = "set_separate_reduce_scatter_group"
ALLOCATE = "set_allocate_memory_from_process_group_for_comm"
SYMM_MEM = "set_symm_mem_for_comm"
#: The fields of a call that a comm is handed and that must match between two runs.
COMPARED = ("input", "input_shape", "dtype", "output_shape", "op", "async_op", "ranks")

# The non-deprecated collectives where torch has them (2.13 deprecates reduce_scatter_tensor and
# all_gather_into_tensor for these); the same positional signature either way.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _call_record(output_tensor, input_tensor, group, op, async_op) -> Dict[str, Any]:
    return {"input": input_tensor.detach().clone(), "input_shape": tuple(input_tensor.shape),
            "dtype": str(input_tensor.dtype), "output_shape": tuple(output_tensor.shape), "op": str(op),
            "async_op": async_op, "ranks": tuple(dist.get_process_group_ranks(group)),
            "group_name": group.group_name}


class RecordingReduceScatter(ReduceScatter):
    """Records each call, then reduce-scatters natively. ``previous_alive``: whether the input handed to the
    previous call of this step is still alive (a weak reference) when this call starts."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []
        self.previous_alive: List[bool] = []
        self._previous: Optional[weakref.ref] = None

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.previous_alive.append(self._previous is not None and self._previous() is not None)
        self._previous = weakref.ref(input_tensor)
        self.calls.append(_call_record(output_tensor, input_tensor, group, op, async_op))
        return _reduce_scatter(output_tensor, input_tensor, op, group, async_op)

    def new_step(self) -> None:
        self._previous = None


class RecordingAllGather(AllGather):
    """Records each call (``op`` is ``None``: an all-gather has none), then all-gathers natively."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append(_call_record(output_tensor, input_tensor, group, None, async_op))
        return _all_gather(output_tensor, input_tensor, group, async_op)


def _build(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _units(model: nn.Module) -> List[Any]:
    return [model[0], model[2], model]


def _install(model: nn.Module, reduce_scatter: Optional[ReduceScatter], all_gather: Optional[AllGather]) -> None:
    for unit in _units(model):
        if reduce_scatter is not None:
            unit.set_custom_reduce_scatter(reduce_scatter)
        if all_gather is not None:
            unit.set_custom_all_gather(all_gather)


def _comm_classes(model: nn.Module) -> List[List[str]]:
    """``[[all-gather comm class, reduce-scatter comm class]]`` for each ``Linear`` unit's parameter group."""
    groups = [model[i]._get_fsdp_state()._fsdp_param_groups[0] for i in (0, 2)]
    return [[type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__] for g in groups]


def _train(model: nn.Module, rank: int, reduce_scatter: Optional[RecordingReduceScatter]) -> Dict[str, torch.Tensor]:
    """2 SGD steps on inputs that depend on the rank only; each ``Linear`` unit's local shards afterwards."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        if reduce_scatter is not None:
            reduce_scatter.new_step()
        model(torch.randn(4, 8, generator=inputs)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.to_local().detach().clone() for name, param in model.named_parameters()}


def _error(call: Callable[[], Any]) -> Optional[List[str]]:
    try:
        call()
    except Exception as error:  # what torch raises is the measurement
        return [type(error).__name__, str(error)]
    return None


def _recorded_run(mesh, rank: int, configure: Callable[[nn.Module], Any], gather: bool = True) -> Dict[str, Any]:
    """Build, ``configure`` (before the comms are installed), install the recording comms, train."""
    model = _build(mesh)
    extra = configure(model) or {}
    reduce_scatter, all_gather = RecordingReduceScatter(), RecordingAllGather() if gather else None
    _install(model, reduce_scatter, all_gather)
    params = _train(model, rank, reduce_scatter)
    return {"rs": reduce_scatter.calls, "ag": all_gather.calls if all_gather else [], "params": params,
            "previous_alive": reduce_scatter.previous_alive, "comms": _comm_classes(model),
            "max_input_buffers": getattr(model._get_fsdp_state()._comm_ctx, "reduce_scatter_max_input_buffers", None),
            **extra}


def _after_custom(mesh, rank: int, gather: bool) -> Dict[str, Any]:
    """Recording comms installed first, then ``set_allocate_memory_from_process_group_for_comm(True)`` and
    ``(False)`` on each unit; what each raised, the comms each leaves, and training after it."""
    model = _build(mesh)
    reduce_scatter, all_gather = RecordingReduceScatter(), RecordingAllGather() if gather else None
    _install(model, reduce_scatter, all_gather)
    raised, comms = {}, {}
    for enable in (True, False):
        raised[str(enable)] = [_error(lambda u=unit: getattr(u, ALLOCATE)(enable)) for unit in _units(model)]
        comms[str(enable)] = _comm_classes(model)
    params = _train(model, rank, reduce_scatter)
    return {"rs": reduce_scatter.calls, "ag": all_gather.calls if all_gather else [], "params": params,
            "raised": raised, "comms": comms}


def _symm_mem(mesh) -> Dict[str, Any]:
    """``set_symm_mem_for_comm()`` on a ``Linear`` unit: with no custom comm, with a custom all-gather (and
    reduce-scatter), with a custom reduce-scatter alone; what it raised and the comms it left."""
    out = {}
    for name, gather, scatter in (("none", False, False), ("both", True, True), ("rs_only", False, True)):
        model = _build(mesh)
        _install(model, RecordingReduceScatter() if scatter else None, RecordingAllGather() if gather else None)
        out[name] = {"raised": _error(lambda: getattr(model[0], SYMM_MEM)()), "comms": _comm_classes(model)[0]}
    return out


def _run(rank: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        results: Dict[str, Any] = {"baseline": _recorded_run(mesh, rank, lambda model: None)}
        if hasattr(FSDPModule, MAX_BUFFERS):
            results[MAX_BUFFERS] = _recorded_run(mesh, rank, lambda model: getattr(model, MAX_BUFFERS)(2))
        if hasattr(FSDPModule, SEPARATE_GROUP):
            results[SEPARATE_GROUP] = _recorded_run(mesh, rank, lambda model: getattr(model, SEPARATE_GROUP)(True))
        if hasattr(FSDPModule, ALLOCATE):
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            supports = getattr(backend, "supports_tensor_alloc", None)

            def before(model):
                return {"raised": [_error(lambda u=unit: getattr(u, ALLOCATE)(True)) for unit in _units(model)]}
            results[ALLOCATE] = {
                "supports_tensor_alloc": None if supports is None else supports(torch.device("cpu")),
                "before": _recorded_run(mesh, rank, before),
                "before_rs_only": _recorded_run(mesh, rank, before, gather=False),
                "after": _after_custom(mesh, rank, gather=True),
                "after_rs_only": _after_custom(mesh, rank, gather=False),
            }
        if hasattr(FSDPModule, SYMM_MEM):
            results[SYMM_MEM] = _symm_mem(mesh)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> List[Dict[str, Any]]:
    """Every scenario's recordings, one dict per rank (one spawn of 2 ranks for the module)."""
    folder = tmp_path_factory.mktemp("fsdp2_setters")
    mp.spawn(_run, args=(str(folder / "store"), str(folder)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _need(setter: str) -> None:
    if not hasattr(FSDPModule, setter):
        pytest.skip(f"FSDPModule.{setter} does not exist in torch {torch.__version__}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_same_calls(got: List[Dict[str, Any]], want: List[Dict[str, Any]], where: str) -> None:
    __tracebackhide__ = True
    assert len(got) == len(want), f"{len(got)} calls, but should be {len(want)} [{where}]"
    for index, (a, b) in enumerate(zip(got, want)):
        for field in COMPARED[1:]:
            assert a[field] == b[field], f"call {index}: {field}={a[field]!r}, but should be {b[field]!r} [{where}]"
        differ = int((a["input"].view(torch.uint8) != b["input"].view(torch.uint8)).sum())
        assert _same_bits(a["input"], b["input"]), f"call {index}: input differs in {differ} bytes of " \
            f"{b['input'].numel() * b['input'].element_size()}, but should in none [{where}]"


def _assert_same_params(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], where: str) -> None:
    __tracebackhide__ = True
    assert sorted(got) == sorted(want), where
    for name in want:
        assert _same_bits(got[name], want[name]), f"{name} differs from the run without the setter [{where}]"


def test_the_baseline_records_what_fsdp2_hands_its_comms(measured):
    """The recordings the other tests compare against are not empty: per step one reduce-scatter per ``Linear``
    unit, float32, one op for every call, ``async_op=False``, over ranks (0, 1), the output a half of the input;
    all-gathers besides; and the two ranks hand different gradients, so a comparison of bits can fail."""
    for rank, result in enumerate(measured):
        base = result["baseline"]
        assert len(base["rs"]) == 2 * STEPS and len(base["ag"]) >= 2 * STEPS, (rank, len(base["rs"]), len(base["ag"]))
        assert {c["ranks"] for c in base["rs"] + base["ag"]} == {(0, 1)}
        assert {c["async_op"] for c in base["rs"]} == {False}
        assert {c["dtype"] for c in base["rs"]} == {"torch.float32"}
        assert len({c["op"] for c in base["rs"]}) == 1, [c["op"] for c in base["rs"]]
        assert all(c["output_shape"][0] * WORLD_SIZE == c["input_shape"][0] for c in base["rs"])
    assert not torch.equal(measured[0]["baseline"]["rs"][0]["input"], measured[1]["baseline"]["rs"][0]["input"])


def test_max_input_buffers_retains_buffers_but_hands_the_comm_the_same_calls(measured):
    """``set_reduce_scatter_max_input_buffers(2)`` (``_fsdp_param_group.py``, ``FSDPParamGroup.post_backward``)
    only changes when FSDP2 drops the previous reduce-scatter's input: with the default 1 it is freed before the
    next unit's reduce-scatter, with 2 it is still alive then (the setter took effect). What the comm is handed,
    call by call and bit for bit, and the trained parameters are those without it: no configuration of its own."""
    _need(MAX_BUFFERS)
    for rank, result in enumerate(measured):
        base, got = result["baseline"], result[MAX_BUFFERS]
        caps = (base["max_input_buffers"], got["max_input_buffers"])
        assert caps == (1, 2), caps
        assert base["previous_alive"] == [False, False] * STEPS, base["previous_alive"]
        assert got["previous_alive"] == [False, True] * STEPS, got["previous_alive"]
        _assert_same_calls(got["rs"], base["rs"], f"rank {rank} reduce-scatter, {MAX_BUFFERS}(2)")
        _assert_same_calls(got["ag"], base["ag"], f"rank {rank} all-gather, {MAX_BUFFERS}(2)")
        _assert_same_params(got["params"], base["params"], f"rank {rank}, {MAX_BUFFERS}(2)")


def test_separate_reduce_scatter_group_hands_a_new_group_over_the_same_ranks(measured):
    """``set_separate_reduce_scatter_group(True)`` (``FSDPParamGroup._set_separate_reduce_scatter_group`` and
    ``_reduce_scatter_process_group``) hands the reduce-scatter comm another ``ProcessGroup`` than the all-gather
    comm (``dist.new_group`` over the same ranks, one shared by both units), where without it both get the shard
    group. That is all that changes: the ranks, every input's bits and the trained parameters are the same, so a
    comm that uses the group it is handed needs no configuration of its own; one that ignores it for a group of
    its own still reduces over the same ranks."""
    _need(SEPARATE_GROUP)
    for rank, result in enumerate(measured):
        base, got = result["baseline"], result[SEPARATE_GROUP]
        assert {c["group_name"] for c in base["rs"]} == {c["group_name"] for c in base["ag"]}, rank
        scatter_groups = {c["group_name"] for c in got["rs"]}
        assert len(scatter_groups) == 1 and scatter_groups.isdisjoint(c["group_name"] for c in got["ag"]), rank
        _assert_same_calls(got["rs"], base["rs"], f"rank {rank} reduce-scatter, {SEPARATE_GROUP}(True)")
        _assert_same_calls(got["ag"], base["ag"], f"rank {rank} all-gather, {SEPARATE_GROUP}(True)")
        _assert_same_params(got["params"], base["params"], f"rank {rank}, {SEPARATE_GROUP}(True)")


def test_allocate_from_process_group_before_a_custom_comm_is_replaced_by_it(measured):
    """``set_allocate_memory_from_process_group_for_comm(True)`` (``FSDPParamGroup.
    set_allocate_memory_from_process_group``) swaps the default comms for ``ProcessGroupAlloc*`` ones; a custom
    comm installed afterwards simply replaces its own kind (``set_custom_*`` assign), so the comm is handed the
    same calls and training is bitwise the same. Installed alone, the custom reduce-scatter leaves the
    ``ProcessGroupAllocAllGather``, which on gloo allocates with ``torch.empty`` (no tensor allocation of its
    own: ``supports_tensor_alloc`` is False), so nothing changes either."""
    _need(ALLOCATE)
    for rank, result in enumerate(measured):
        base, alloc = result["baseline"], result[ALLOCATE]
        assert alloc["supports_tensor_alloc"] is False, alloc["supports_tensor_alloc"]
        for name, comms in (("before", ["RecordingAllGather", "RecordingReduceScatter"]),
                            ("before_rs_only", ["ProcessGroupAllocAllGather", "RecordingReduceScatter"])):
            got = alloc[name]
            assert got["raised"] == [None] * 3, got["raised"]
            assert got["comms"] == [comms] * 2, got["comms"]
            _assert_same_calls(got["rs"], base["rs"], f"rank {rank} reduce-scatter, {ALLOCATE} then custom ({name})")
            if name == "before":
                _assert_same_calls(got["ag"], base["ag"], f"rank {rank} all-gather, {ALLOCATE} then custom")
            _assert_same_params(got["params"], base["params"], f"rank {rank}, {ALLOCATE} then custom ({name})")


def test_allocate_from_process_group_after_a_custom_comm_raises_and_may_swap_the_all_gather(measured):
    """After a custom comm, ``set_allocate_memory_from_process_group_for_comm`` raises ``AssertionError`` for
    ``True`` and ``False`` alike, on each unit with a parameter group (the root has none, so it raises nothing).
    It checks the all-gather comm first: with a custom all-gather it raises naming it and changes nothing; with a
    custom reduce-scatter alone it first swaps the default all-gather for ``ProcessGroupAllocAllGather`` (for
    ``True``; back to ``DefaultAllGather`` for ``False``), then raises naming the reduce-scatter: a partial change.
    The custom comms stay installed and are handed the same calls as without the setter."""
    _need(ALLOCATE)
    message = "cannot call set_allocate_memory_from_process_group() when {} comm is custom: {}"
    for rank, result in enumerate(measured):
        base, alloc = result["baseline"], result[ALLOCATE]
        both, alone = alloc["after"], alloc["after_rs_only"]
        for enable in ("True", "False"):
            assert both["raised"][enable] == [["AssertionError", message.format("all gather", "RecordingAllGather")]
                                              ] * 2 + [None], both["raised"]
            assert alone["raised"][enable] == [["AssertionError", message.format(
                "reduce scatter", "RecordingReduceScatter")]] * 2 + [None], alone["raised"]
        for enable in ("True", "False"):
            assert both["comms"][enable] == [["RecordingAllGather", "RecordingReduceScatter"]] * 2, both["comms"]
        # the partial change: (True) swapped the all-gather before raising, (False) swapped it back
        assert alone["comms"]["True"] == [["ProcessGroupAllocAllGather", "RecordingReduceScatter"]] * 2, alone
        assert alone["comms"]["False"] == [["DefaultAllGather", "RecordingReduceScatter"]] * 2, alone["comms"]
        _assert_same_calls(both["rs"], base["rs"], f"rank {rank} reduce-scatter, custom then {ALLOCATE}")
        _assert_same_calls(both["ag"], base["ag"], f"rank {rank} all-gather, custom then {ALLOCATE}")
        _assert_same_calls(alone["rs"], base["rs"], f"rank {rank} reduce-scatter alone, custom then {ALLOCATE}")
        _assert_same_params(both["params"], base["params"], f"rank {rank}, custom then {ALLOCATE}")
        _assert_same_params(alone["params"], base["params"], f"rank {rank}, custom alone then {ALLOCATE}")


def test_symm_mem_raises_on_cpu_and_refuses_a_custom_all_gather_first(measured):
    """``set_symm_mem_for_comm()`` (``FSDPParamGroup.set_symm_mem``; ``SymmMemAllocMixin`` in
    ``_fsdp_collectives.py``) builds a ``SymmMemAllGather``, whose ``symm_mem.set_backend("NCCL")`` raises
    ``RuntimeError`` on a CPU build, before any comm is swapped. With a custom all-gather installed it raises
    ``AssertionError`` naming it, before touching symmetric memory; with a custom reduce-scatter alone it reaches
    the all-gather swap first, so on CPU it is the same ``RuntimeError``. Either way the comms are unchanged:
    on gloo the setter cannot be combined with a custom comm, nor used at all."""
    _need(SYMM_MEM)
    nccl = ["RuntimeError", "SymmetricMemory does not find allocation backend NCCL"]
    for result in measured:
        got = result[SYMM_MEM]
        assert got["none"] == {"raised": nccl, "comms": ["DefaultAllGather", "DefaultReduceScatter"]}, got["none"]
        assert got["both"] == {"raised": ["AssertionError", "cannot call set_symm_mem() when all gather comm is "
                                          "custom: RecordingAllGather"],
                               "comms": ["RecordingAllGather", "RecordingReduceScatter"]}, got["both"]
        assert got["rs_only"] == {"raised": nccl, "comms": ["DefaultAllGather", "RecordingReduceScatter"]}, got


def test_symm_mem_under_nccl_is_not_checked_on_gloo():
    """Under NCCL on CUDA ``set_symm_mem_for_comm`` gets past the all-gather swap (a ``SymmMemAllGather``), so
    with a custom reduce-scatter alone it would raise only after that swap, and without a custom comm it would
    change how the all-gather buffer is allocated. None of that runs on gloo or CPU, so it is not checked here."""
    pytest.skip(f"set_symm_mem_for_comm needs NCCL symmetric memory on CUDA devices (torch {torch.__version__}, "
                f"{torch.cuda.device_count()} CUDA devices here); this module runs gloo on CPU")
