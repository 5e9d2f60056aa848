"""A zoo of FSDP2 custom all-gather comms (``FSDPModule.set_custom_all_gather``): known-good and known-bad.

``tests/test_meta_fsdp2_all_gather.py`` runs the suite's ``test_fsdp2_all_gather_*`` checks over these. Each
known-good spec must pass every case; each known-bad spec must be caught where ``EXPECTED_CATCH`` says, and
only there where the entry says why no other case can.

What "good" means is fixed by FSDP2 itself (``foreach_all_gather`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, torch 2.13): FSDP2 allocates the flat output
with ``comm.allocate((group_size * shard_numel,), dtype=<parameter dtype>, device=...)``, copies this rank's
shard into its chunk (``input_tensor`` is a view of it), calls
``comm(output_tensor=..., input_tensor=..., group=<shard group>, async_op=...)``, waits on a ``Work`` the comm
returns, and reads the unsharded parameters out of ``output_tensor``.

Only ``torch`` and ``torch.distributed`` are imported at module level: the zoo is imported by the controller
and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.apis.fsdp2_all_gather.builtin_hooks import PlainAllGather
from conformance.spec import HookSpec

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD"]


def _chunks(output_tensor: torch.Tensor, group: Any) -> List[torch.Tensor]:
    return list(output_tensor.new_empty(output_tensor.shape).chunk(dist.get_world_size(group)))


# -- known good ---------------------------------------------------------------------------------------


class ListCatAllGather(PlainAllGather):
    """Right: ``dist.all_gather`` into a list of chunks, then the chunks concatenated in rank order into
    ``output_tensor`` (how comms written before ``all_gather_into_tensor`` existed do it)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        chunks = _chunks(output_tensor, group)
        dist.all_gather(chunks, input_tensor.clone(), group)  # the group positionally: the recorder binds it
        torch.cat(chunks, out=output_tensor)
        return None


class AsyncReturnsWork(PlainAllGather):
    """Right: always launches the all-gather with ``async_op=True`` and returns its ``Work``: FSDP2 waits on a
    returned ``Work`` before it reads the output, even where it passed ``async_op=False``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)


# -- known bad ----------------------------------------------------------------------------------------


class ReversedOrder(PlainAllGather):
    """Wrong: concatenates the chunks in reverse rank order (a ring written the wrong way round)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        chunks = _chunks(output_tensor, group)
        dist.all_gather(chunks, input_tensor.clone(), group=group)
        torch.cat(chunks[::-1], out=output_tensor)
        return None


class CachedGather(PlainAllGather):
    """Wrong: "parameters only change at the optimizer step", so it serves the first gather of each shard size
    again from a cache: right in step 0 (the backward's re-gather holds the same parameters), stale from step 1."""

    def __init__(self) -> None:
        self.cache: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        key = (input_tensor.numel(), input_tensor.dtype)
        if key not in self.cache:
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            self.cache[key] = output_tensor.clone()
        output_tensor.copy_(self.cache[key])
        return None


class Bf16Wire(PlainAllGather):
    """Wrong with float32 parameters: gathers in bfloat16 to halve the traffic (exact only where the parameters
    are bfloat16 already, which this claim is not)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        wire = torch.empty(output_tensor.shape, dtype=torch.bfloat16, device=output_tensor.device)
        dist.all_gather_into_tensor(wire, input_tensor.to(torch.bfloat16), group=group)
        output_tensor.copy_(wire)
        return None


class DefaultGroup(PlainAllGather):
    """Wrong where the shard group is not the default group (HSDP's shard group, a data-parallel sub-mesh):
    gathers with no ``group=``. On a 1-D mesh over the whole pool it is right."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)


class DroppedWork(PlainAllGather):
    """Wrong: launches the all-gather with ``async_op=True`` and returns ``None``, neither waiting nor returning
    the ``Work``: FSDP2 reads ``output_tensor`` before the collective wrote it (whatever the race gives)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        return None


class Bf16Alloc(PlainAllGather):
    """Wrong: ``allocate`` ignores ``dtype`` and returns bfloat16 buffers (a pool of one dtype)."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=torch.bfloat16, device=device)


class ScaledByOne(PlainAllGather):
    """Wrong, only on hard values: multiplies the gathered output by a scale of 1.0 (an identity "dequantize"
    left in), which is exact for every finite value, -0.0 and subnormals, but quiets a signalling NaN (its bits
    change): an all-gather only moves data."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
        output_tensor.mul_(1.0)
        return None


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_plain_instance", api="fsdp2_all_gather", hook=PlainAllGather(),
             description="PlainAllGather, as an instance shared by every model"),
    HookSpec(name="good_list_cat", api="fsdp2_all_gather", hook=ListCatAllGather,
             description="dist.all_gather into a list, then cat in rank order"),
    HookSpec(name="good_async_returns_work", api="fsdp2_all_gather", hook=AsyncReturnsWork,
             description="async_op=True all-gather, its Work returned for FSDP2 to wait on"),
]

KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_reversed_order", api="fsdp2_all_gather", hook=ReversedOrder,
             description="concatenates the shards in reverse rank order"),
    HookSpec(name="bad_cached_gather", api="fsdp2_all_gather", hook=CachedGather,
             description="serves the first gather of each shard size again"),
    HookSpec(name="bad_bf16_wire", api="fsdp2_all_gather", hook=Bf16Wire,
             description="gathers in bfloat16, float32 parameters"),
    HookSpec(name="bad_default_group", api="fsdp2_all_gather", hook=DefaultGroup,
             description="gathers over the default group, ignoring group"),
    HookSpec(name="bad_dropped_work", api="fsdp2_all_gather", hook=DroppedWork,
             description="async_op=True all-gather, Work neither waited on nor returned"),
    HookSpec(name="bad_bf16_alloc", api="fsdp2_all_gather", hook=Bf16Alloc,
             description="allocate returns bfloat16 whatever dtype is asked"),
    HookSpec(name="bad_scaled_by_one", api="fsdp2_all_gather", hook=ScaledByOne,
             description="multiplies the gathered output by 1.0 (quiets signalling NaNs)"),
]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: Where each known-bad comm must be caught (check, configs) and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_reversed_order": "parity in every config, at step 0: every unit's parameters are the other ranks' shards",
    "bad_cached_gather": ("parity in every config, at step 1 and not before: step 0's re-gather in the backward "
                          "holds the same parameters; after the optimizer step the cache is stale"),
    "bad_bf16_wire": "parity in every config, at step 0: float32 parameters lose 16 bits of their fraction",
    "bad_default_group": ("parity on hsdp and subgroup only: on a 1-D mesh over the pool the shard group is the "
                          "default group; on a 2-rank shard group of 4 ranks the gather over all 4 raises"),
    "bad_dropped_work": "parity in every config: the recorder sees the Work dropped, whatever the race gives",
    "bad_bf16_alloc": "parity in every config: allocate's buffer is not the dtype FSDP2 asked for",
    "bad_scaled_by_one": ("hard_params only: x * 1.0 is exact on every value training produces; a signalling NaN "
                          "comes back quiet"),
}
