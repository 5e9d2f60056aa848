"""The reference models (``models/``) as the model tests build them: plainly, over a stand-in group, or wrapped in
FSDP1 over a single-rank gloo group (the ``fsdp1`` fixture of ``tests/conftest.py``)."""

from __future__ import annotations

import warnings
from typing import Any, Set

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.models import MODELS

CPU = torch.device("cpu")
#: What FSDP1 puts before the name of every module and parameter it wraps.
FSDP_PREFIX = "_fsdp_wrapped_module."


class StandInGroup:
    """Stand-in for a ProcessGroup in unwrapped builds (only ``size``/``rank``)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def plain_build(name: str, rank: int = 0, world_size: int = 2) -> nn.Module:
    """Model ``name`` built without FSDP, as rank ``rank`` of ``world_size`` would build it."""
    return MODELS[name].build(group=StandInGroup(world_size, rank), device=CPU, fsdp_kwargs=None)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, so that ``torch.equal`` compares bit patterns
    (NaN payloads and the sign of zero included)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def unwrapped(name: str) -> str:
    """A module's or parameter's name under FSDP1 as the plain model names it (:data:`FSDP_PREFIX` removed)."""
    return name.replace(FSDP_PREFIX, "")


class Fsdp1Builds:
    """FSDP1 (``FullyShardedDataParallel``) builds of the reference models over ``group``, on the CPU."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.group = group
        #: ``torch.distributed.fsdp.FullyShardedDataParallel``.
        self.FSDP = FullyShardedDataParallel

    def build(self, name: str, strategy: str = "NO_SHARD", **extra: Any) -> nn.Module:
        """Model ``name`` wrapped by its own FSDP build, with ``sharding_strategy`` ``strategy`` (a
        ``ShardingStrategy`` name), ``use_orig_params=True`` and ``extra`` FSDP keyword arguments over those. FSDP1's
        warning that it clamps a sharded strategy to ``NO_SHARD`` on one rank is silenced."""
        from torch.distributed.fsdp import ShardingStrategy

        kwargs = dict(sharding_strategy=ShardingStrategy[strategy], use_orig_params=True)
        kwargs.update(extra)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
            return MODELS[name].build(group=self.group, device=CPU, fsdp_kwargs=kwargs)

    def unit_paths(self, model: nn.Module) -> Set[str]:
        """The module paths of ``model``'s FSDP units, as the plain model names them (``""``: the root)."""
        return {unwrapped(n) for n, m in model.named_modules() if isinstance(m, self.FSDP)}
