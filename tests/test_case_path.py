"""A case's path is as short as docs/architecture.md ("One case, end to end") says, read from real stacks.

On a rank (one gloo rank for DDP and FSDP1; two spawned ones for an FSDP2 comm, which FSDP2 does not call on a
group of one): the stack at the hook's call, from the rank check down, passes the check's module, the lock-step loop,
the shared training step and the API's recorder, and no other module of the suite (the hook is called by PyTorch
from the training step's backward). On the controller: the stack at ``Pool.run``, from the suite test's call of
``Runner.run_case`` down, holds the runner's frames alone. A wrapper, a closure or a module put back between
them fails here, and the page must then be written again.
"""

from __future__ import annotations

import ast
import inspect
import os
import types
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as ddp_default_hooks
from torch.distributed.algorithms._comm_hooks import default_hooks as fsdp_default_hooks

import conformance
from conformance.apis.registry import HOOK_APIS
from conformance.controller.runner import Runner
from conformance.controller.settings import resolve
from conformance.protocol import CaseResult, CheckResult, RankOutcome
from conformance.ranks.checks import get_rank_check
from conformance.ranks.worker import RankContext
from conformance.shared.spec_loading import LoadedSpec
from conformance.spec import HookSpec

PACKAGE = os.path.dirname(os.path.abspath(conformance.__file__))

#: The suite's modules between a rank check and the hook, in order, after the check's own (docs/architecture.md,
#: hops 5 to 8); the API's recorder module is the last.
RANK_PATH = ("ranks/checks/lockstep.py", "ranks/checks/common.py")
#: The suite's frames at most at the hook, from the check's down (parity, lockstep, LockstepRun.run, _one_step,
#: hooked_step, train_step, the recorder's __call__).
RANK_FRAMES = 7


def suite_frames(stack: List[inspect.FrameInfo]) -> List[Tuple[str, str]]:
    """``(module path under conformance/, function)`` of each of the suite's frames, outermost first."""
    frames = []
    for info in reversed(stack):
        path = os.path.abspath(info.filename)
        if path.startswith(PACKAGE + os.sep):
            frames.append((os.path.relpath(path, PACKAGE).replace(os.sep, "/"), info.function))
    return frames


def modules(frames: List[Tuple[str, str]]) -> List[str]:
    """The modules of ``frames`` in order, each once per run of consecutive frames (a hop per change)."""
    out: List[str] = []
    for module, _ in frames:
        if not out or out[-1] != module:
            out.append(module)
    return out


STACKS: List[List[Tuple[str, str]]] = []


def _note_stack() -> None:
    if not STACKS:
        STACKS.append(suite_frames(inspect.stack()))


def ddp_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    _note_stack()
    return ddp_default_hooks.allreduce_hook(process_group, bucket)


def fsdp_hook(state: Any, grad: torch.Tensor, output: Any = None) -> None:
    _note_stack()
    fsdp_default_hooks.allreduce_hook(state, grad)


def _pg_state(process_group: Any) -> Any:
    return process_group


def _fsdp2_comm() -> Any:
    """FSDP2's reference comm, noting the stack at its call (FSDP2 calls no comm on a group of one)."""
    from conformance.apis.fsdp2.builtin_hooks import PlainReduceScatter

    class NotedReduceScatter(PlainReduceScatter):  # type: ignore[misc,valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _note_stack()
            return super().__call__(*args, **kwargs)

    return NotedReduceScatter


def _fsdp_state(process_group: Any) -> Any:
    return fsdp_default_hooks.DefaultState(process_group)


#: API -> (its spec's fields, the parity case's parameters): the APIs that call their hook on one rank, so the stack
#: is read in this process.
CASES = {
    "ddp": (dict(hook=ddp_hook, state=_pg_state), {"config": "default", "model": "nested_wrapped"}),
    "fsdp": (dict(hook=fsdp_hook, state=_fsdp_state), {"strategy": "NO_SHARD", "model": "nested_wrapped"}),
}


def _parity_stack(api: str, fields: Any, params: Any, group: Any, rank: int = 0, world_size: int = 1
                  ) -> List[Tuple[str, str]]:
    """The suite's frames at the hook's first call in ``api``'s parity check, one step on this rank."""
    spec = HookSpec(name="noted", api=api, **fields)
    STACKS.clear()
    ctx = RankContext(rank, world_size, group, torch.device("cpu"), "gloo")
    result = get_rank_check(f"{api}.parity")(ctx, spec, steps=1, **params)
    findings = result.findings if isinstance(result, CheckResult) else result
    assert not findings, findings
    assert STACKS, f"{api} never called the hook"
    return STACKS[0]


def _assert_rank_path(api: str, frames: List[Tuple[str, str]]) -> None:
    start = next(i for i, (module, function) in enumerate(frames) if function == "parity")
    path = modules(frames[start:])
    assert path[0] == "ranks/checks/exact.py", frames[start:]
    assert tuple(path[1:3]) == RANK_PATH, frames[start:]
    assert len(path) == 4 and path[3].startswith(f"apis/{api}/"), \
        f"one recorder module of the API's, then the hook; the stack: {frames[start:]}"
    assert len(frames) - start <= RANK_FRAMES, frames[start:]


@pytest.mark.parametrize("api", sorted(CASES))
def test_a_rank_reaches_the_hook_through_the_check_the_loop_the_training_step_and_the_recorder(gloo_group, api):
    fields, params = CASES[api]
    _assert_rank_path(api, _parity_stack(api, fields, params, gloo_group))


def _fsdp2_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        frames = _parity_stack("fsdp2", dict(hook=_fsdp2_comm()), {"config": "default", "model": "nested_wrapped"},
                               dist.group.WORLD, rank, 2)
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                f.write(repr(frames))
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_rank_reaches_its_comm_the_same_way(tmp_path):
    if not hasattr(torch.distributed.fsdp, "FSDPModule"):
        pytest.skip("FSDP2 (torch.distributed.fsdp.FSDPModule) is not in this torch")
    out = tmp_path / "frames"
    mp.spawn(_fsdp2_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    _assert_rank_path("fsdp2", ast.literal_eval(out.read_text(encoding="utf-8")))


class NotingPool:
    """A pool that notes the stack it is run from and answers every rank with no findings."""

    config = types.SimpleNamespace(world_size=2)

    def __init__(self) -> None:
        self.stacks: List[List[Tuple[str, str]]] = []

    def serve(self, specs: Any) -> None:
        pass

    def reap(self) -> None:
        pass

    def run(self, case: Any) -> CaseResult:
        self.stacks.append(suite_frames(inspect.stack()))
        outcomes = tuple(RankOutcome(rank=r, ok=True, value=CheckResult()) for r in range(2))
        return CaseResult(case=case, world_size=2, outcomes=outcomes)


def test_the_controller_reaches_the_pool_through_the_runner_alone():
    settings = resolve(lambda dest: [] if dest in ("conform_hooks", "conform_known_failures") else None,
                       env={}, gpu_count=0)
    spec = HookSpec(name="h", api="ddp", hook=ddp_hook, state=_pg_state)
    runner = Runner(settings, [LoadedSpec("pkg.mod:SPEC", spec, "--hook")])
    pool = NotingPool()
    runner.pools[2], runner.serving = pool, "h"
    case = HOOK_APIS["ddp"].suite_test("parity").case("h", "default", 2, model="nested_wrapped")
    node = types.SimpleNamespace(name=f"test_ddp_parity[{case.id}]", user_properties=[],
                                 get_closest_marker=lambda name: None)
    runner.run_case(types.SimpleNamespace(node=node), case)
    frames = pool.stacks[0]
    start = next(i for i, (_, function) in enumerate(frames) if function == "run_case")
    assert modules(frames[start:]) == ["controller/runner.py"], frames[start:]
    assert [f for _, f in frames[start:]] == ["run_case", "run", "run_on"]
