"""What FSDP2 hands an all-reduce hook, as the suite records it (``fsdp2_all_reduce`` and ``fsdp2_replica``).

:class:`HookRecorder` stands between FSDP2 and a hook installed with
``FSDPModule.set_all_reduce_hook``: it forwards every call unchanged, and records
each call's dtype and size, its input, its in-place result and its collectives
for the checks and the diagnosis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from conformance.protocol import Finding, FindingKind
from conformance.ranks import hook_code, reach
from conformance.ranks.checks.models import Recorder
from conformance.ulps import dtype_name
from conformance.ranks.hook_call import CallLog, HookCall, counting_collectives

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["HookRecorder", "allocation_problem"]


class HookRecorder(Recorder):
    """Wraps an all-reduce hook; records each call's dtype and size, its input, in-place result and collectives.
    ``rank``: this rank, for findings; ``mesh_shape``: the HSDP mesh's ``(replicate, shard)`` (``(world size, 1)``
    under ``replicate``), for the note on a gradient finding; ``group``: the process group the diagnosis
    recomputes each call over (``None``: the check's)."""

    def __init__(self, hook: Callable[[torch.Tensor], object], rank: int, mesh_shape: Tuple[int, int],
                 group: Optional[ProcessGroup] = None):
        self.hook = hook
        self.rank = rank
        self.mesh_shape = mesh_shape
        self.group = group
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.log = CallLog()

    def __call__(self, tensor: torch.Tensor) -> Any:
        index = sum(1 for c in self.calls if c["step"] == self.step)
        self.calls.append({"step": self.step, "dtype": tensor.dtype, "numel": tensor.numel()})
        reach.saw_buffer(tensor)
        if not self.recording:
            with hook_code.running(self.hook):
                return self.hook(tensor)
        call = self.log.add(HookCall(self.step, index, f"call {index} ({tensor.numel()} elements)",
                                     tensor.detach().reshape(-1).clone(), group=self.group))
        with counting_collectives() as count, hook_code.running(self.hook):
            result = self.hook(tensor)
        call.collectives = count.issued
        call.group_sizes = tuple(count.group_sizes)
        call.settle_from(tensor)
        return result

    def dtypes(self, step: int) -> str:
        """The dtypes of the tensors the hook got in ``step``, ``/``-joined (``"?"``: no call)."""
        return "/".join(sorted({dtype_name(c["dtype"]) for c in self.calls if c["step"] == step})) or "?"

    def context(self, step: int) -> str:
        """The dtypes of the all-reduced gradients the hook got in ``step``: the note on a gradient finding."""
        replicate, shard = self.mesh_shape
        if shard == 1:
            return f"the hook got the all-reduced {self.dtypes(step)} whole gradients of {replicate} replicas"
        return f"the hook got the all-reduced {self.dtypes(step)} gradients of a {replicate}x{shard} HSDP mesh"

    def findings(self, step: int) -> List[Finding]:
        """A finished step in which FSDP2 never called the hook (every call is forwarded as it is, so only a
        finished step can show something)."""
        if not any(c["step"] == step for c in self.calls):
            return [Finding(self.rank, "FSDP2 never called the all-reduce hook in this step", step=step,
                            kind=FindingKind.CONTRACT)]
        return []


def allocation_problem(out: object, size: Sequence[Union[int, torch.SymInt]], dtype: torch.dtype,
                       device: torch.device) -> Optional[Dict[str, Any]]:
    """What is wrong with the tensor a comm's ``allocate(size, *, dtype, device)`` returned (FSDP2's
    ``ReduceScatter`` and ``AllGather`` comm protocols: FSDP2 reads and writes the buffer as asked), as
    ``{"size", "dtype", "got"}``; ``None`` where it has exactly that shape, dtype and device type."""
    want = torch.Size([int(s) for s in size])
    if not isinstance(out, torch.Tensor):
        return {"size": tuple(want), "dtype": dtype, "got": f"a {type(out).__name__}, not a tensor"}
    if out.shape != want or out.dtype != dtype or out.device.type != torch.device(device).type:
        return {"size": tuple(want), "dtype": dtype,
                "got": f"shape {tuple(out.shape)}, {dtype_name(out.dtype)} on {out.device}"}
    return None
