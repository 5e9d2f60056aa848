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


#: The alignment, in elements, of :class:`PaddedWire`'s shards on the wire (64 bytes of float32).
WIRE_ALIGN = 16
#: The piece of :class:`ChunkedGather`'s chunk loop, in elements (4 MiB of float32), and the shard size above
#: which it loops: FSDP2 hands it a shard that large only on a model of production size.
CHUNK = 1 << 20


def _padded_gather(input_tensor: torch.Tensor, group: Any) -> Tuple[torch.Tensor, int]:
    """The shards of ``group``, each padded with zeros to a multiple of :data:`WIRE_ALIGN` elements, gathered:
    ``(wire, padded shard size)``."""
    n = input_tensor.numel()
    padded = -(-n // WIRE_ALIGN) * WIRE_ALIGN
    shard = input_tensor.new_zeros(padded)
    shard[:n] = input_tensor
    wire = input_tensor.new_empty(padded * dist.get_world_size(group))
    dist.all_gather_into_tensor(wire, shard, group=group)
    return wire, padded


class PaddedWire(PlainAllGather):
    """Right: pads each shard to a multiple of :data:`WIRE_ALIGN` elements for the wire (aligned buffers, as
    comms for NCCL or a custom transport do) and strips the padding when it copies the gather out."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        wire, padded = _padded_gather(input_tensor, group)
        n = input_tensor.numel()
        output_tensor.view(-1, n).copy_(wire.view(-1, padded)[:, :n])
        return None


class BroadcastGather(PlainAllGather):
    """Right: one broadcast per rank of the group, from its global rank (``broadcast`` takes a global ``src``),
    into the chunk of its rank in the group (where FSDP2 put each rank's own shard)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        chunks = output_tensor.chunk(dist.get_world_size(group))
        for j, src in enumerate(dist.get_process_group_ranks(group)):
            if src == dist.get_rank():
                chunks[j].copy_(input_tensor)
            dist.broadcast(chunks[j], src=src, group=group)
        return None


class ChunkedGather(PlainAllGather):
    """Right: gathers a shard of more than :data:`CHUNK` elements in pieces of :data:`CHUNK` (to bound the
    staging memory), the last, shorter piece included; a smaller shard in one all-gather."""

    drop_tail = False

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        n = input_tensor.numel()
        if n <= CHUNK:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        out = output_tensor.view(-1, n)
        stop = n - n % CHUNK if self.drop_tail else n
        for start in range(0, stop, CHUNK):
            piece = input_tensor[start:start + CHUNK].contiguous()
            staged = piece.new_empty(out.shape[0] * piece.numel())
            dist.all_gather_into_tensor(staged, piece, group=group)
            out[:, start:start + piece.numel()].copy_(staged.view(out.shape[0], -1))
        return None


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


class PaddingKept(PlainAllGather):
    """Wrong: pads each shard for the wire as :class:`PaddedWire`, then copies the first ``output_tensor.numel()``
    elements of the padded gather out: the padding stays between the shards, which land at the wrong offsets
    (right only where the shard size is a multiple of :data:`WIRE_ALIGN`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        wire, _ = _padded_gather(input_tensor, group)
        output_tensor.copy_(wire[:output_tensor.numel()])
        return None


class GlobalRankSlots(PlainAllGather):
    """Wrong where the group's ranks are not consecutive from a multiple of its size (a data-parallel sub-mesh,
    {0,2} and {1,3}): :class:`BroadcastGather` with each rank's chunk indexed by its global rank modulo the
    group size (``dist.get_rank()`` where ``dist.get_rank(group)`` was meant). Right on a 1-D mesh over the
    pool and on HSDP's shard groups ({0,1}, {2,3})."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[Any]:
        chunks = output_tensor.chunk(dist.get_world_size(group))
        mine = input_tensor.clone()  # a view of a chunk another rank's broadcast may overwrite
        for src in dist.get_process_group_ranks(group):
            slot = chunks[src % len(chunks)]
            if src == dist.get_rank():
                slot.copy_(mine)
            dist.broadcast(slot, src=src, group=group)
        return None


class ChunkedDropsTail(ChunkedGather):
    """Wrong above :data:`CHUNK` elements only: the chunk loop stops at the last whole piece, so the last
    ``n % CHUNK`` elements of every other rank's shard are never gathered (a dropped tail at production size)."""

    drop_tail = True


KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_plain_instance", api="fsdp2_all_gather", hook=PlainAllGather(),
             description="PlainAllGather, as an instance shared by every model"),
    HookSpec(name="good_list_cat", api="fsdp2_all_gather", hook=ListCatAllGather,
             description="dist.all_gather into a list, then cat in rank order"),
    HookSpec(name="good_async_returns_work", api="fsdp2_all_gather", hook=AsyncReturnsWork,
             description="async_op=True all-gather, its Work returned for FSDP2 to wait on"),
    HookSpec(name="good_padded_wire", api="fsdp2_all_gather", hook=PaddedWire,
             description="shards padded to 16 elements on the wire, the padding stripped"),
    HookSpec(name="good_broadcast_gather", api="fsdp2_all_gather", hook=BroadcastGather,
             description="one broadcast per rank of the group, into the chunk of its rank in the group"),
    HookSpec(name="good_chunked", api="fsdp2_all_gather", hook=ChunkedGather,
             description="shards above 2^20 elements gathered in 2^20-element pieces, the tail included"),
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
    HookSpec(name="bad_padding_kept", api="fsdp2_all_gather", hook=PaddingKept,
             description="shards padded to 16 elements on the wire, the padding kept in the output"),
    HookSpec(name="bad_global_rank_slots", api="fsdp2_all_gather", hook=GlobalRankSlots,
             description="broadcast gather, chunks indexed by the global rank modulo the group size"),
    HookSpec(name="bad_chunked_drops_tail", api="fsdp2_all_gather", hook=ChunkedDropsTail,
             description="shards above 2^20 elements gathered in pieces, the last shorter one dropped"),
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
    "bad_padding_kept": ("parity in every config, at step 0: no flat shard of the suite's models is a multiple of "
                         "16 elements, so every shard but the first lands at a wrong offset"),
    "bad_global_rank_slots": ("subgroup only (parity and hard_params): on the pool's mesh and on HSDP's shard groups "
                              "{0,1} and {2,3} the global rank modulo the group size is the rank in the group; on "
                              "{0,2} and {1,3} both ranks write chunk 0 (or chunk 1)"),
    "bad_chunked_drops_tail": ("hard_params on large_probe only (the production-size case): no shard of the other "
                               "models exceeds 2^20 elements; wide's of 3,310,003 (2 ranks) or 2,206,669 (3) loses "
                               "its last 164,787 or 110,029 elements"),
}
