"""What FSDP2 hands a custom reduce-scatter comm, as the suite records it.

:class:`CommRecorder` stands between ``fully_shard`` and the comm under test
(``FSDPModule.set_custom_reduce_scatter``): it forwards every call unchanged
and turns what it saw into findings: an ``allocate`` that returned the wrong
buffer, a comm that returned unfinished work, a step in which FSDP2 never
called the comm, and the ops, groups and dtypes it was called with (the context
of a gradient finding). An all-reduce hook's recorder is
:class:`~conformance.apis.fsdp2_common.recorders.HookRecorder`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from conformance.apis.fsdp2_common.recorders import allocation_problem
from conformance.protocol import Finding, FindingKind
from conformance.ranks import hook_code, reach
from conformance.ranks.checks.models import Recorder
from conformance.ulps import dtype_name
from conformance.ranks.hook_call import CallLog, HookCall, counting_collectives


def op_name(op: object) -> str:
    """``AVG``, ``SUM``, ``PREMUL_SUM(0.25)``, ... for a ``ReduceOp`` or ``RedOpType``."""
    inner = getattr(op, "op", None)
    if inner is not None:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        name = str(inner).split(".")[-1]
        return f"{name}({factor!r})" if factor is not None else name
    return str(op).split(".")[-1]


class CommRecorder(Recorder):
    """Wraps the comm under test; forwards FSDP2's calls unchanged and records them.

    ``allocate`` and ``__call__`` are forwarded with exactly the arguments FSDP2
    passed (FSDP2 calls the comm with keywords ``output_tensor``,
    ``input_tensor``, ``group``, ``op``), so a comm whose parameter names differ
    fails here as it would in training. ``allocate`` results are checked against
    the request: FSDP2 views them as ``(world_size, -1)`` and writes the cast
    gradients into them, so a wrong size, dtype or device changes the result.
    ``rank``: this rank, for findings. ``never_called``: why FSDP2 calls no comm in this setting (``replicate``
    on FSDP2, which has no shard group), or ``None``: then a step without a call is a contract finding.
    """

    def __init__(self, comm: Any, rank: int, never_called: Optional[str] = None):  # Any: the user's comm object
        self.comm = comm
        self.rank = rank
        self.never_called = never_called
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.bad_allocations: List[Dict[str, Any]] = []
        self.unfinished: List[Dict[str, Any]] = []
        self.log = CallLog()

    def allocate(self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        with hook_code.running(self.comm):
            out = self.comm.allocate(size, dtype=dtype, device=device)
        bad = allocation_problem(out, size, dtype, device)
        if bad is not None:
            self.bad_allocations.append({"step": self.step, **bad})
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # Any: FSDP2's arguments, forwarded as they came
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        op = kwargs.get("op", args[3] if len(args) > 3 else None)
        inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        out = kwargs.get("output_tensor", args[0] if args else None)
        index = sum(1 for c in self.calls if c["step"] == self.step)
        self.calls.append({
            "step": self.step,
            "op": op_name(op),
            "group_size": None if group is None else group.size(),
            "dtype": None if inp is None else inp.dtype,
        })
        reach.saw_buffer(inp)
        call = None
        if self.recording and isinstance(inp, torch.Tensor) and isinstance(out, torch.Tensor) and group is not None:
            call = self.log.add(HookCall(self.step, index, f"call {index} ({inp.numel()} elements)",
                                         inp.detach().reshape(-1).clone(), sharded=True, group=group, op=op))
        if not self.recording:
            with hook_code.running(self.comm):
                result = self.comm(*args, **kwargs)
            self._check_finished(result, kwargs.get("async_op", args[4] if len(args) > 4 else False), index)
            return result
        with counting_collectives() as count, hook_code.running(self.comm):
            result = self.comm(*args, **kwargs)
        unfinished = self._check_finished(result, kwargs.get("async_op", args[4] if len(args) > 4 else False), index)
        if call is not None:
            # Read the result now, before FSDP2 post-divides the output buffer in place; a comm that
            # returned unfinished work is read when the diagnosis needs it (CallLog.of_step).
            call.pending, call.collectives, call.group_sizes = out, count.issued, tuple(count.group_sizes)
            if not unfinished:
                call.settle()
        return result

    def _check_finished(self, result: object, async_op: object, index: int) -> bool:
        """Whether ``result`` is a ``Work`` that had not completed when the comm returned; called without
        ``async_op=True`` (FSDP2's reduce-scatter never passes it: ``foreach_reduce`` calls
        ``reduce_scatter_comm(output_tensor=..., input_tensor=..., group=..., op=...)`` and ignores what it
        returns), such a comm broke its contract: FSDP2 reads the output at once, before the collective wrote
        it. Recorded for :meth:`findings_so_far`, recording or not."""
        done = getattr(result, "is_completed", None)
        unfinished = callable(done) and not done()
        if unfinished and not async_op:
            self.unfinished.append({"step": self.step, "index": index})
        return unfinished

    def unused(self) -> Optional[str]:
        """Where FSDP2 calls no comm by design and never called this one: what the user should know."""
        if self.never_called is None or self.calls:
            return None
        return self.never_called

    def summary(self, step: int) -> str:
        seen = sorted({(c["op"], c["group_size"], dtype_name(c["dtype"])) for c in self.calls if c["step"] == step})
        return "; ".join(f"op={o} over a group of {g} in {d}" for o, g, d in seen) or "not called"

    def context(self, step: int) -> str:
        """What FSDP2 called the comm with in ``step``: the note on a gradient finding."""
        return f"FSDP2 called the comm with {self.summary(step)}"

    def findings_so_far(self, step: int) -> List[Finding]:
        """The first wrong ``allocate`` of ``step``, and the first call that returned unfinished work, as findings;
        what a step that raised can still report."""
        out = []
        for bad in self.bad_allocations:
            if bad["step"] == step:
                out.append(Finding(self.rank, f"comm.allocate(size={bad['size']}, dtype={dtype_name(bad['dtype'])}) "
                                          f"returned {bad['got']}: FSDP2 writes the reduce-dtype gradients into "
                                          "exactly that buffer", step=step, kind=FindingKind.CONTRACT))
                break
        for late in self.unfinished:
            if late["step"] == step:
                out.append(Finding(self.rank, f"call {late['index']}: the comm returned a Work that had not completed, "
                                          "called without async_op=True: FSDP2's reduce-scatter ignores what the comm "
                                          "returns and reads output_tensor at once, before the collective wrote it; "
                                          "wait on the work before returning", step=step, kind=FindingKind.CONTRACT))
                break
        return out

    def findings(self, step: int) -> List[Finding]:
        """What the finished ``step`` shows: :meth:`findings_so_far`, and a step in which the comm was never called."""
        out = self.findings_so_far(step)
        if self.never_called is None and not any(c["step"] == step for c in self.calls):
            out.append(Finding(self.rank, "FSDP2 never called the comm in this step (set_custom_reduce_scatter did "
                                     "not take effect)", step=step, kind=FindingKind.CONTRACT))
        return out
