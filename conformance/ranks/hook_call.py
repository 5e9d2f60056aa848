"""What a recorder keeps of the hook's calls (:class:`HookCall`, :class:`CallLog`) and the collectives it counts.

Its own module so that :mod:`conformance.ranks.arithmetic` (which recomputes a
call) and :mod:`conformance.ranks.diagnosis` (which records and explains calls)
both import it, and neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["CallLog", "Collectives", "HookCall", "counting_collectives"]

#: ``torch.distributed`` functions counted while the hook runs (:func:`counting_collectives`).
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_gather",
               "all_gather_into_tensor", "_all_gather_base", "broadcast", "reduce", "all_to_all_single",
               "all_to_all", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
#: Recorded calls kept per recorder: the failing step and the one before it (for "stale").
KEEP_STEPS = 2


@dataclasses.dataclass
class HookCall:
    """One call of the hook under test on this rank.

    Attributes:
        step: the training step (0-based).
        index: the call's position among the step's calls (DDP: the bucket index).
        where: what the call reduced, for messages (``"bucket 0 [fc.weight, ...]"``).
        input: the local gradient the hook received, 1-D, cloned before the call.
        output: what the hook produced, 1-D (the shard of a reduce-scatter).
        sharded: ``output`` is this rank's shard of a reduce-scatter over ``input``
            (``input.numel() == world_size * output.numel()``), else an all-reduce.
        collectives: ``torch.distributed`` collectives the hook issued during the call.
        group_sizes: the size of the process group each of those ran over.
        group: the process group the API passed the hook (FSDP2), else ``None``
            (the rank check's group).
        op: the ``ReduceOp`` the API asked for (FSDP2), else ``None``.
        pending: the API's output buffer, read (cloned into ``output``) once the
            call has completed (FSDP2 may wait on a comm after it returns).
    """

    step: int
    index: int
    where: str
    input: torch.Tensor
    output: Optional[torch.Tensor] = None
    sharded: bool = False
    collectives: int = 0
    group_sizes: Tuple[int, ...] = ()
    group: Any = None
    op: Any = None
    pending: Optional[torch.Tensor] = None

    def settle_from(self, tensor: torch.Tensor) -> None:
        """Read the call's result from ``tensor`` now."""
        self.pending = tensor
        self.settle()

    def settle(self) -> None:
        """Clone the pending output buffer into ``output`` (the call has completed)."""
        if self.pending is not None:
            self.output, self.pending = self.pending.detach().reshape(-1).clone(), None


class CallLog:
    """The :class:`HookCall` s of a recorder, the last :data:`KEEP_STEPS` steps only."""

    def __init__(self) -> None:
        self.calls: List[HookCall] = []

    def add(self, call: HookCall) -> HookCall:
        for old in self.calls:
            if old.step < call.step:
                old.settle()  # a call of an earlier step has completed; its buffer may be reused now
        self.calls = [c for c in self.calls if c.step > call.step - KEEP_STEPS] + [call]
        return call

    def of_step(self, step: int) -> List[HookCall]:
        """The completed calls of ``step`` with a result, by index (pending buffers read now)."""
        for call in self.calls:
            if call.step == step:
                call.settle()
        return sorted((c for c in self.calls if c.step == step and c.output is not None), key=lambda c: c.index)


class Collectives(List[int]):
    """What :func:`counting_collectives` saw: ``[count]``, and ``group_sizes``, the size of the process group
    each call ran over (the default group's where it was given none)."""

    def __init__(self) -> None:
        super().__init__([0])
        self.group_sizes: List[int] = []


#: ``inspect.signature`` of each wrapped ``torch.distributed`` function, once: it is read on every collective a
#: hook issues, in every case.
_signature = functools.lru_cache(maxsize=None)(inspect.signature)


def _group_size(fn: Callable, args: Any, kwargs: Any) -> int:
    """The size of the group a ``torch.distributed`` call runs over (``group=None``: the default group)."""
    try:
        group = _signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
    except (TypeError, ValueError):  # a signature it cannot bind: the call itself will say what is wrong
        group = kwargs.get("group")
    try:
        return dist.get_world_size(group)
    except Exception:  # noqa: BLE001 - a group object this torch does not take; sizes are a diagnosis aid
        return -1


@contextlib.contextmanager
def counting_collectives() -> Iterator[Collectives]:
    """Count calls of the :data:`COLLECTIVES` through ``torch.distributed`` inside the block, and the size of
    the process group each ran over.

    Yields a :class:`Collectives`, whose item 0 is the count so far. Calls made
    through a name imported before the block (``from torch.distributed import
    all_reduce``) are not seen, so "no collective seen" is worded as such.
    """
    count = Collectives()
    saved: Dict[str, Any] = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def counted(*args: Any, __fn: Callable = fn, **kwargs: Any) -> Any:
            count[0] += 1
            count.group_sizes.append(_group_size(__fn, args, kwargs))
            return __fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield count
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
