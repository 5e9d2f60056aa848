"""Training on a process group that is not the default one: the ``subgroup`` cases of every hook API.

Every other case trains on the pool's default group (WORLD), where a hook that
ignores the group it is given and reduces over WORLD instead gets the same
answer. Here a pool of ``N`` ranks (``N`` even, at least 4) splits into the
data-parallel groups ``{0, N/2}, {1, N/2 + 1}, ...``: every rank trains in a
group of two, beside the other groups, on data of its own. A hook that reduces
over WORLD mixes the groups' gradients and differs from the reference; one that
takes its shard index from the global rank (2 is rank 1 of ``{0, 2}``) too.

:func:`on_subgroup` gives a check a :class:`SubgroupContext`: the same
``RankContext`` with ``group`` and ``world_size`` of this rank's subgroup. Its
``rank`` stays the global rank, so inputs (and findings) differ per group;
``any_rank`` still agrees over the whole pool, so every rank stops together.
Which pool the subgroup cases run on is the plans' business
(:func:`conformance.apis.subgroup_world_size`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from conformance.apis import SUBGROUP_WORLD_SIZE
from conformance.shared.standalone_main import data_parallel_groups

_SUBGROUPS: Dict[Tuple[int, int], Any] = {}


def subgroup_ranks(world_size: int) -> List[List[int]]:
    """The data-parallel groups of a pool: ``[[0, N/2], [1, N/2 + 1], ...]``.

    Raises:
        ValueError: ``world_size`` is odd or below :data:`SUBGROUP_WORLD_SIZE`.
    """
    if world_size % 2 or world_size < SUBGROUP_WORLD_SIZE:
        raise ValueError(f"the subgroup cases need an even world size of at least {SUBGROUP_WORLD_SIZE}, "
                         f"got {world_size}")
    return data_parallel_groups(world_size)


class CheckContext(Protocol):
    """What every rank check and API model gets as ``ctx``: the pool's
    :class:`~conformance.ranks.worker.RankContext`, or a :class:`SubgroupContext` over it (a structural type, so
    that the checks and the API folders name it without importing the worker)."""

    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]  # None: the default group
    device: torch.device
    backend: str

    @property
    def current_phase(self) -> str: ...

    def any_rank(self, flag: bool) -> bool: ...

    def phase(self, text: str) -> None: ...

    def notice(self, text: str) -> None: ...

    def report_on_error(self, collect: Optional[Callable[[], List[Any]]]) -> None: ...


class SubgroupContext:
    """``ctx`` with this rank's data-parallel subgroup as its ``group`` (see the module docstring).

    Attributes:
        rank: the global rank (inputs differ per group; findings name it).
        world_size: the subgroup's size (2).
        group: the subgroup, a ``ProcessGroup`` from ``dist.new_subgroups_by_enumeration``.
        parent: the pool's ``RankContext``.
    """

    def __init__(self, parent: CheckContext, group: dist.ProcessGroup, size: int):
        self.parent = parent
        self.rank = parent.rank
        self.world_size = size
        self.group = group
        self.device = parent.device
        self.backend = parent.backend

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of the whole pool (every group stops together)."""
        return self.parent.any_rank(flag)

    def phase(self, text: str) -> None:
        self.parent.phase(text)

    def notice(self, text: str) -> None:
        self.parent.notice(text)

    def report_on_error(self, collect: Optional[Callable[[], List[Any]]]) -> None:
        self.parent.report_on_error(collect)

    @property
    def current_phase(self) -> str:
        return self.parent.current_phase


def on_subgroup(ctx: CheckContext) -> SubgroupContext:
    """This rank's :class:`SubgroupContext`; the groups are made once per pool (collective over WORLD)."""
    key = (id(ctx.group), ctx.world_size)
    if key not in _SUBGROUPS:
        mine, _ = dist.new_subgroups_by_enumeration(subgroup_ranks(ctx.world_size))
        _SUBGROUPS[key] = mine
    group = _SUBGROUPS[key]
    return SubgroupContext(ctx, group, 2)

