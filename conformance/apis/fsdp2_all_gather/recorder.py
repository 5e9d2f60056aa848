"""What FSDP2 hands a custom all-gather comm, and what the comm leaves, as the suite records it.

:class:`AllGatherRecorder` stands between ``fully_shard`` and the comm under test
(``FSDPModule.set_custom_all_gather``): it forwards every call unchanged, with
exactly FSDP2's arguments (``foreach_all_gather`` calls
``comm(output_tensor=..., input_tensor=..., group=..., async_op=...)`` after
``comm.allocate((world_size * shard_numel,), dtype=<parameter dtype>, device=...)``),
and checks each call where FSDP2 cannot: the buffer ``allocate`` returned, the
``Work`` of a collective the comm launched with ``async_op=True`` and neither
waited on nor returned (FSDP2 waits on a returned ``Work`` only, even when it
passed ``async_op=False``), and the gathered output, bit for bit, against the
shards of the group FSDP2 passed, gathered again by the recorder over that group
(:mod:`~conformance.apis.fsdp2_all_gather.arithmetic` names the cause of a
wrong one). A wrong gather corrupts the parameters of the forward and backward;
the gradients and parameters the lockstep compares then differ too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from conformance.apis.fsdp2_all_gather.arithmetic import GatherCall, explain, findings_text, same_bits
from conformance.apis.fsdp2_common.recorders import allocation_problem
from conformance.protocol import Finding, FindingKind
from conformance.ranks import cost, hook_code, reach
from conformance.ranks.checks.models import Recorder
from conformance.ranks.hook_call import CallLog, watching_works
from conformance.ulps import dtype_name

#: Wrong gathers reported per step and rank (the first ones; the others say the same).
MAX_REPORTED = 2


class AllGatherRecorder(Recorder):
    """Wraps the all-gather comm under test; forwards FSDP2's calls unchanged, records and checks them.

    ``rank``: this rank, for findings. Each call's output is checked once the call completed (the comm returned,
    and its returned ``Work`` was waited on, as FSDP2 does): one ``all_gather_into_tensor`` of the recorder's
    over the group FSDP2 passed, so every rank of that group checks every call; not while
    :attr:`~conformance.ranks.checks.models.Recorder.recording` is off (a long run's unrecorded pass).
    """

    def __init__(self, comm: Any, rank: int,  # Any: the user's comm object
                 notice: Optional[Callable[[str], None]] = None):
        self.comm = comm
        self.rank = rank
        self.notice = notice
        self.step = 0
        self.log = CallLog()  # no reduction to diagnose: the recorder names a wrong gather's cause itself
        self.calls: List[Dict[str, Any]] = []
        self.bad_allocations: List[Dict[str, Any]] = []
        self.dropped: List[Dict[str, Any]] = []
        self.wrong: List[GatherCall] = []
        self.pending_group: List[Dict[str, Any]] = []
        self._outputs: Dict[int, Dict[int, torch.Tensor]] = {}

    def allocate(self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        with hook_code.running(self.comm):
            out = self.comm.allocate(size, dtype=dtype, device=device)
        bad = allocation_problem(out, size, dtype, device)
        if bad is not None:
            self.bad_allocations.append({"step": self.step, **bad})
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # Any: FSDP2's arguments, forwarded as they came
        out = kwargs.get("output_tensor", args[0] if args else None)
        inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        index = sum(1 for c in self.calls if c["step"] == self.step)
        group_size = dist.get_world_size(group)
        self.calls.append({"step": self.step, "group_size": group_size,
                           "dtype": None if inp is None else inp.dtype,
                           "numel": None if inp is None else inp.numel()})
        reach.saw_buffer(out)  # the buffer the comm fills: group_size shards (the reach's "buffers up to")
        # FSDP2's input_tensor is a view of output_tensor: keep it before the call (not in a long run's unrecorded
        # pass, whose gradient comparison catches a wrong gather; its replay records and names the cause)
        shard = inp.detach().clone() if self.recording else None
        with watching_works() as works, hook_code.running(self.comm):
            # the calls it made are seen as they start: where one raises, findings_so_far still reads them
            self.pending_group.append({"step": self.step, "index": index, "group_size": group_size,
                                       "calls": works.calls})
            result = self.comm(*args, **kwargs)
        self.pending_group.pop()
        if works.left(result):
            if self.notice is not None and not any(late["step"] == self.step for late in self.dropped):
                self.notice(_dropped_text(index))  # gloo may abort this rank for the Work left running
            self.dropped.append({"step": self.step, "index": index})
            return result  # FSDP2 reads output_tensor now: what it holds is unknown until the work completes
        if shard is None:
            return result
        if isinstance(result, dist.Work):
            result.wait()  # FSDP2 waits on it before it reads output_tensor
        expected = torch.empty_like(out)
        with cost.suite_own():  # the suite's check of the call, never the comm's cost
            dist.all_gather_into_tensor(expected, shard.to(out.dtype), group=group)
        got = out.detach().reshape(-1).clone()
        previous = self._outputs.get(self.step - 1, {}).get(index)
        self._outputs.setdefault(self.step, {})[index] = got
        self._outputs = {s: v for s, v in self._outputs.items() if s >= self.step - 1}
        if not same_bits(got, expected.reshape(-1)):
            others = tuple(size for _, size in works.calls if size != group_size)
            self.wrong.append(GatherCall(self.step, index, got, expected.reshape(-1), group_size, others, previous,
                                         tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
        return result

    def summary(self, step: int) -> str:
        seen = sorted({(c["group_size"], dtype_name(c["dtype"])) for c in self.calls if c["step"] == step})
        count = sum(1 for c in self.calls if c["step"] == step)
        return (f"{count} time{'' if count == 1 else 's'}, " +
                "; ".join(f"over a group of {g} in {d}" for g, d in seen)) if seen else "not called"

    def context(self, step: int) -> str:
        """What FSDP2 called the comm with in ``step``: the note on a gradient finding."""
        return f"FSDP2 called the all-gather comm {self.summary(step)}"

    def findings_so_far(self, step: int) -> List[Finding]:
        """A wrong ``allocate``, a dropped ``Work``, a wrong gather of ``step``, and a call that raised after a
        collective over another group than FSDP2's: what a step that raised can still report."""
        out: List[Finding] = []
        for bad in self.bad_allocations:
            if bad["step"] == step:
                out.append(Finding(self.rank, f"comm.allocate(size={bad['size']}, dtype={dtype_name(bad['dtype'])}) "
                                          f"returned {bad['got']}: FSDP2 copies the parameter shards into exactly "
                                          "that buffer and reads the unsharded parameters out of it; return "
                                          "torch.empty(size, dtype=dtype, device=device) or a buffer of exactly "
                                          "that size, dtype and device", step=step, kind=FindingKind.CONTRACT))
                break
        for late in self.dropped:
            if late["step"] == step:
                out.append(Finding(self.rank, _dropped_text(late["index"]), step=step, kind=FindingKind.CONTRACT))
                break
        for pending in self.pending_group:
            others = sorted({(name, size) for name, size in pending["calls"] if size != pending["group_size"]})
            if pending["step"] == step and others:
                ran = ", ".join(f"{name} over a group of {size}" for name, size in others)
                out.append(Finding(self.rank, f"call {pending['index']}: the comm ran {ran} ranks where FSDP2 passed "
                                          f"it a group of {pending['group_size']} (a collective with no group= runs "
                                          "over the default group); fix: pass group=group (the group FSDP2 passes "
                                          "the comm)", step=step, kind=FindingKind.CONTRACT))
        for call in [c for c in self.wrong if c.step == step][:MAX_REPORTED]:
            head, line = findings_text(call)
            out.append(Finding(self.rank, head, step=step, kind=FindingKind.MISMATCH))
            out.append(Finding(self.rank, line, step=step, kind=FindingKind.DIAGNOSIS if explain(call) is not None
                               else FindingKind.NO_KNOWN_CAUSE))
        return out

    def findings(self, step: int) -> List[Finding]:
        """What the finished ``step`` shows: :meth:`findings_so_far`, and a step in which the comm was never called."""
        out = self.findings_so_far(step)
        if not any(c["step"] == step for c in self.calls):
            out.append(Finding(self.rank, "FSDP2 never called the all-gather comm in this step "
                                     "(set_custom_all_gather did not take effect)", step=step,
                               kind=FindingKind.CONTRACT))
        return out


def _dropped_text(index: int) -> str:
    return (f"call {index}: the comm launched an all-gather with async_op=True and neither waited on its Work nor "
            "returned it: FSDP2 waits only on a Work the comm returns, and otherwise reads output_tensor at once, "
            "before the collective wrote it; return the Work (or wait on it before returning)")
