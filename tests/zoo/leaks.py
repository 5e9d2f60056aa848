"""DDP hooks that are right in their arithmetic but leave their rank process changed, and the hooks that
a shared process would let them harm (tests/test_isolation.py).

Every leaker averages exactly as DDP does (scale by ``1 / world_size``, SUM), so its only fault is
what it leaves behind: a default dtype, a global module hook, a monkeypatched ``torch.distributed``
function (in its *state factory*, outside any hook call), a destroyed default process group, closed
standard streams, memory that only grows. The suite must fail each leaker's own case with a finding
that names the change (``LEAK_NAMES``), and no leaker may move another hook's verdict:
``VICTIMS`` must get the verdict they get alone, whichever leaker ran before them.

``GOOD`` hooks change nothing global (they count calls in their own state, or print), and must
conform: the fingerprint must not blame ordinary hook behaviour.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec

#: The originals, captured at import: the leakers themselves reduce with these, so their own
#: arithmetic stays right while what they leave behind is wrong.
_ALL_REDUCE = dist.all_reduce


def _note_pid(name: str) -> None:
    """Where ``CONFORM_TEST_PID_DIR`` is set, leave a file ``<name>.<pid>`` there: which process ran
    which hook (tests/test_isolation.py)."""
    where = os.environ.get("CONFORM_TEST_PID_DIR")
    if where:
        open(os.path.join(where, f"{name}.{os.getpid()}"), "w").close()


def _mean(process_group: Any, tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    tensor.mul_(1.0 / process_group.size())
    return _ALL_REDUCE(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def _done(tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _mean_now(process_group: Any, bucket: Any) -> torch.Tensor:
    """The bucket averaged as DDP does, waited for (the leakers act after their reduction finished)."""
    tensor = bucket.buffer().mul_(1.0 / process_group.size())
    _ALL_REDUCE(tensor, group=process_group)
    return tensor


# -- leakers ---------------------------------------------------------------------------------------


def leak_default_dtype(process_group, bucket):
    """Averages right, and sets the default dtype to float64 on its first call (never back)."""
    _note_pid("leak_default_dtype")
    fut = _mean(process_group, bucket.buffer())
    torch.set_default_dtype(torch.float64)
    return fut


def leak_module_forward_hook(process_group, bucket):
    """Averages right, and registers a global forward hook that scales every module's output by 2."""
    _note_pid("leak_module_forward_hook")
    if not getattr(leak_module_forward_hook, "handle", None):
        leak_module_forward_hook.handle = torch.nn.modules.module.register_module_forward_hook(  # type: ignore[attr-defined]
            lambda module, args, output: output * 2 if isinstance(output, torch.Tensor) else output)
    return _mean(process_group, bucket.buffer())


def _patch_all_reduce_state(process_group: Any) -> Any:
    """The state factory: replaces ``torch.distributed.all_reduce`` with one that averages every SUM
    (outside any hook call), then returns the process group."""
    if dist.all_reduce is _ALL_REDUCE:
        @functools.wraps(_ALL_REDUCE)
        def averaging_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = _ALL_REDUCE(tensor, op=op, group=group, async_op=async_op)
            if not async_op:
                tensor.div_(dist.get_world_size(group))
            return work

        dist.all_reduce = averaging_all_reduce
    return process_group


def leak_patched_all_reduce(process_group, bucket):
    """Averages right with the original all_reduce; its state factory patched dist.all_reduce."""
    return _mean(process_group, bucket.buffer())


def leak_destroys_group(process_group, bucket):
    """Averages right, waits, then destroys the default process group."""
    tensor = _mean_now(process_group, bucket)
    if dist.is_initialized():
        dist.destroy_process_group()
    return _done(tensor)


def leak_closes_stdout(process_group, bucket):
    """Averages right, then closes ``sys.stdout`` and ``sys.stderr``."""
    sys.stdout.close()
    sys.stderr.close()
    return _mean(process_group, bucket.buffer())


def leak_closes_fds(process_group, bucket):
    """Averages right, then closes file descriptors 1 and 2 (the rank's output)."""
    for fd in (1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    return _mean(process_group, bucket.buffer())


_KEPT: List[torch.Tensor] = []


def leak_memory(process_group, bucket):
    """Averages right, and keeps 16 MiB (touched, so resident) from every call."""
    _KEPT.append(torch.ones(4 * 2**20))
    return _mean(process_group, bucket.buffer())


def leak_torch_modes(process_group, bucket):
    """Averages right, and turns on deterministic algorithms, sets 3 intra-op threads and 'medium'
    float32 matmul precision."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(3)
    torch.set_float32_matmul_precision("medium")
    return _mean(process_group, bucket.buffer())


# -- victims: their verdicts must not depend on what ran before them ---------------------------------


def victim_mean(process_group, bucket):
    """The README's my_ddp_mean: DDP's own averaging. Conforms."""
    _note_pid("victim_mean")
    tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(process_group))
    return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def victim_float64(process_group, bucket):
    """Reduces in float64 while it claims float32 (the default): 1 ULP off at 3 ranks, so it must fail
    parity there. Under a float64 default dtype its reference would be float64 too, and it would pass."""
    buffer = bucket.buffer()
    wide = buffer.to(torch.float64).mul_(1.0 / dist.get_world_size(process_group))
    dist.all_reduce(wide, group=process_group)
    buffer.copy_(wide.to(buffer.dtype))
    return _done(buffer)


def victim_sum(process_group, bucket):
    """SUM without averaging, through ``dist.all_reduce`` as found at call time: must fail averaging."""
    _note_pid("victim_sum")
    return dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future().then(
        lambda f: f.value()[0])


# -- good hooks that only count or print ----------------------------------------------------------------


class CountingState:
    """A state object that counts calls: ordinary hook state, nothing global."""

    def __init__(self, process_group: Any):
        self.process_group = process_group
        self.calls = 0


def good_counting(state, bucket):
    state.calls += 1
    _note_pid("good_counting")
    return _mean(state.process_group, bucket.buffer())


def good_printing(process_group, bucket):
    _note_pid("good_printing")
    print(f"good_printing: bucket {bucket.index()} of {bucket.buffer().numel()} elements", flush=True)
    print("good_printing: to stderr too", file=sys.stderr, flush=True)
    return _mean(process_group, bucket.buffer())


def _spec(name: str, hook: Any, description: str, state: Any = None) -> HookSpec:
    return HookSpec(name=name, api="ddp", hook=hook, state=state or (lambda pg: pg), description=description)


LEAKERS = [
    _spec("leak_default_dtype", leak_default_dtype, "sets the default dtype to float64"),
    _spec("leak_module_forward_hook", leak_module_forward_hook, "leaves a global module forward hook"),
    _spec("leak_patched_all_reduce", leak_patched_all_reduce, "its state factory patches dist.all_reduce",
          state=_patch_all_reduce_state),
    _spec("leak_destroys_group", leak_destroys_group, "destroys the default process group"),
    _spec("leak_closes_stdout", leak_closes_stdout, "closes sys.stdout and sys.stderr"),
    _spec("leak_closes_fds", leak_closes_fds, "closes file descriptors 1 and 2"),
    _spec("leak_torch_modes", leak_torch_modes, "deterministic algorithms, 3 threads, medium matmul precision"),
]
#: Run with a small --rank-memory-growth: it fails only on the growth over its cases.
MEMORY = _spec("leak_memory", leak_memory, "keeps 16 MiB per call")
VICTIMS = [
    _spec("victim_mean", victim_mean, "DDP's own averaging"),
    _spec("victim_float64", victim_float64, "reduces in float64, claims float32"),
    _spec("victim_sum", victim_sum, "SUM without averaging"),
]
GOOD = [
    _spec("good_counting", good_counting, "counts its calls in its state", state=CountingState),
    _spec("good_printing", good_printing, "prints on every call"),
]

#: What each leaker's finding must name (a fragment of ``conformance.ranks.process_state.changes``).
LEAK_NAMES: Dict[str, str] = {
    "leak_default_dtype": "torch.get_default_dtype() == torch.float64",
    "leak_module_forward_hook": "register_module_forward_hook",
    "leak_patched_all_reduce": "torch.distributed.all_reduce replaced",
    "leak_destroys_group": "default process group",
    "leak_closes_stdout": "sys.stdout closed",
    "leak_closes_fds": "file descriptor 1 (stdout) closed",
    "leak_torch_modes": "torch.are_deterministic_algorithms_enabled() == True",
    "leak_memory": "resident memory grew",
}

ALL = LEAKERS + VICTIMS + GOOD
#: For torchrun's ranks (tests/test_torchrun.py), at 2 ranks: in a shared process the patched all_reduce
#: would average the SUM of the hook after it, which would then pass averaging.
TORCHRUN = [LEAKERS[2], VICTIMS[2]]
