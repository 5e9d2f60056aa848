"""The switch zoo's FSDP2 reduce-scatter comms (``allocate(size, *, dtype, device)`` and
``__call__(output, input, group, op, async_op)``): a path taken only where two switches hold at once, a warm-up
and a large input, or several nodes and a large input (``tests/zoo/switch_hooks/__init__.py`` says what the zoo
holds). The line that decides each one's other path ends in ``# switch``.
"""

from typing import Any, List

import torch

from conformance.spec import HookSpec
from tests.zoo.reach_hooks.common import _reduce_scatter, _spans_nodes, _Staging, _UnitCalls

#: Calls per input size of FSDP2's own reduce-scatter before the other path may start.
FSDP2_WARMUP_STEPS = 72
#: Reduce-scatter inputs of this many elements and more take the other path (2 MiB of float32).
FSDP2_LARGE_NUMEL = 2 ** 19


class _SwitchComm:
    """``allocate`` as FSDP2's ``DefaultAllocMixin`` (a fresh tensor per call), a call count per input size, and
    persistent staging buffers."""

    def __init__(self) -> None:
        self.units = _UnitCalls()
        self.staging = _Staging()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def native(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
               async_op: bool = False) -> Any:
        return _reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)

    def bf16_wire(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any) -> None:
        """bfloat16 on the wire, the result cast back into ``output_tensor``."""
        low_out = torch.empty(output_tensor.shape, dtype=torch.bfloat16, device=output_tensor.device)
        _reduce_scatter(low_out, input_tensor.to(torch.bfloat16), group, op=op)
        output_tensor.copy_(low_out)

    def staged(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any) -> None:
        """Persistent staging buffers, one reduce-scatter with FSDP2's ``op``, waited on: FSDP2's arithmetic."""
        staged_in = self.staging.get("in", input_tensor).copy_(input_tensor)
        staged_out = self.staging.get("out", output_tensor)
        _reduce_scatter(staged_out, staged_in, group, op=op, async_op=True).wait()
        output_tensor.copy_(staged_out)


class WarmLargeBf16Comm(_SwitchComm):
    """Once warmed up (72 calls per input size), large inputs (2**19 elements and more) go bfloat16 on the wire;
    everything else FSDP2's reduce-scatter. Claims full precision."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        warm = self.units.step_of((input_tensor.numel(), input_tensor.dtype)) >= FSDP2_WARMUP_STEPS
        if warm and input_tensor.numel() >= FSDP2_LARGE_NUMEL:  # switch
            self.bf16_wire(output_tensor, input_tensor, group, op)
            return None
        return self.native(output_tensor, input_tensor, group, op, async_op)


class WarmLargeStagedComm(_SwitchComm):
    """Once warmed up (72 calls per input size), large inputs (2**19 elements and more) go through persistent
    staging buffers; FSDP2's arithmetic on every path."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        warm = self.units.step_of((input_tensor.numel(), input_tensor.dtype)) >= FSDP2_WARMUP_STEPS
        if warm and input_tensor.numel() >= FSDP2_LARGE_NUMEL:  # switch
            self.staged(output_tensor, input_tensor, group, op)
            return None
        return self.native(output_tensor, input_tensor, group, op, async_op)


class NodesLargeBf16Comm(_SwitchComm):
    """Where the shard group spans nodes, large inputs (2**19 elements and more) go bfloat16 on the slow link;
    everything else FSDP2's reduce-scatter. Claims full precision."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if _spans_nodes(group) and input_tensor.numel() >= FSDP2_LARGE_NUMEL:  # switch
            self.bf16_wire(output_tensor, input_tensor, group, op)
            return None
        return self.native(output_tensor, input_tensor, group, op, async_op)


class NodesLargeStagedComm(_SwitchComm):
    """Where the shard group spans nodes, large inputs (2**19 elements and more) go through persistent staging
    buffers; FSDP2's arithmetic on every path."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if _spans_nodes(group) and input_tensor.numel() >= FSDP2_LARGE_NUMEL:  # switch
            self.staged(output_tensor, input_tensor, group, op)
            return None
        return self.native(output_tensor, input_tensor, group, op, async_op)


def _fsdp2(name: str, comm: Any, description: str, **kwargs: Any) -> HookSpec:
    return HookSpec(name=name, api="fsdp2", hook=comm, description=description, **kwargs)


KNOWN_GOOD: List[HookSpec] = [
    _fsdp2("good_fsdp2_warm_large_staged", WarmLargeStagedComm,
           "after 72 calls per input size, inputs >= 2**19 elements staged: FSDP2's arithmetic"),
    _fsdp2("good_fsdp2_nodes_large_staged", NodesLargeStagedComm,
           "across nodes, inputs >= 2**19 elements staged: FSDP2's arithmetic"),
]

KNOWN_BAD: List[HookSpec] = [
    _fsdp2("bad_fsdp2_warm_large_bf16", WarmLargeBf16Comm,
           "after 72 calls per input size, inputs >= 2**19 elements in bfloat16, claiming full precision"),
    _fsdp2("bad_fsdp2_nodes_large_bf16", NodesLargeBf16Comm,
           "across nodes, inputs >= 2**19 elements in bfloat16, claiming full precision"),
]
