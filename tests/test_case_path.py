"""A case's path is as short as docs/architecture.md ("One case, end to end") says, read from real stacks.

On a rank: the stack at the hook's call, from the rank check down, passes the check's module, the lock-step loop,
the shared training step and the API's recorder, and no other module of the suite (the hook is called by PyTorch
from the training step's backward). On the controller: the stack at ``Pool.run``, from the suite test's call of
``Runner.run_case`` down, holds the runner's frames alone. A wrapper, a closure or a module put back between
them fails here, and the page must then be written again.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
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


def _fsdp_state(process_group: Any) -> Any:
    return fsdp_default_hooks.DefaultState(process_group)


#: API -> (its spec's fields, the parity case's parameters): the APIs that call their hook on one rank (FSDP2
#: calls no comm on a group of one), so the stack is read in this process.
CASES = {
    "ddp": (dict(hook=ddp_hook, state=_pg_state), {"config": "default", "model": "nested_wrapped"}),
    "fsdp": (dict(hook=fsdp_hook, state=_fsdp_state), {"strategy": "NO_SHARD", "model": "nested_wrapped"}),
}


@pytest.mark.parametrize("api", sorted(CASES))
def test_a_rank_reaches_the_hook_through_the_check_the_loop_the_training_step_and_the_recorder(gloo_group, api):
    fields, params = CASES[api]
    spec = HookSpec(name="noted", api=api, **fields)
    STACKS.clear()
    ctx = RankContext(0, 1, gloo_group, torch.device("cpu"), "gloo")
    result = get_rank_check(f"{api}.parity")(ctx, spec, steps=1, **params)
    findings = result.findings if isinstance(result, CheckResult) else result
    assert not findings, findings
    if not STACKS:
        pytest.skip(f"{api} never called the hook on one rank with this torch")
    frames = STACKS[0]
    start = next(i for i, (module, function) in enumerate(frames) if function == "parity")
    path = modules(frames[start:])
    assert path[0] == "ranks/checks/exact.py", frames[start:]
    assert tuple(path[1:3]) == RANK_PATH, frames[start:]
    assert len(path) == 4 and path[3].startswith(f"apis/{api}/"), \
        f"one recorder module of the API's, then the hook; the stack: {frames[start:]}"
    assert len(frames) - start <= RANK_FRAMES, frames[start:]


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
