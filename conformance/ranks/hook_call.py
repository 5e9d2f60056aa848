"""What a recorder keeps of the hook's calls (:class:`HookCall`, :class:`CallLog`) and the collectives it counts.

Its own module so that :mod:`conformance.ranks.arithmetic` (which recomputes a
call) and :mod:`conformance.ranks.diagnosis` (which records and explains calls)
both import it, and neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

if TYPE_CHECKING:  # pragma: no cover
    from types import FrameType

__all__ = ["CallLog", "Collectives", "HookCall", "Works", "counting_collectives", "watching_works"]

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
        collectives: the collectives (and point-to-point ops, on gloo) the hook issued during the call, by the
            process groups' own count (:func:`counting_collectives`); ``None`` where this torch keeps no count.
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
    collectives: Optional[int] = 0
    group_sizes: Tuple[int, ...] = ()
    group: Optional[dist.ProcessGroup] = None
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
    each collective ran over. ``known`` is ``False`` where this torch's process groups keep no sequence number
    (the count is then 0 and means nothing)."""

    def __init__(self) -> None:
        super().__init__([0])
        self.group_sizes: List[int] = []
        self.known = True

    @property
    def issued(self) -> Optional[int]:
        """The count, or ``None`` where it is not known."""
        return self[0] if self.known else None


def _process_groups() -> List[Any]:
    """Every process group this process holds (the default group where the registry cannot be read)."""
    try:
        return list(distributed_c10d._world.pg_map)
    except AttributeError:  # a torch without the registry: the default group alone
        return [dist.group.WORLD] if dist.is_initialized() else []


def _sequence_number(group: dist.ProcessGroup) -> Optional[int]:
    """The group's own count of the collectives issued on it (``ProcessGroup._get_sequence_number_for_group``:
    gloo counts every collective and point-to-point op, NCCL its collectives), or ``None``."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without sequence numbers: the count is unknown
        return None


@contextlib.contextmanager
def counting_collectives() -> Iterator[Collectives]:
    """Count the collectives issued inside the block on every process group of this process, and the size of
    the group each ran over, from the process groups' own sequence numbers.

    Nothing of ``torch.distributed`` is replaced or wrapped, so the hook's code sees PyTorch's own objects
    (``dist.P2POp(dist.isend, ...)`` checks that its op *is* ``torch.distributed.isend``), and a collective made
    through a name imported before the block is counted too. Yields a :class:`Collectives`, filled when the
    block ends; collectives issued by another thread during the block (a future's callback on gloo's own
    threads) are counted with it.
    """
    count = Collectives()
    before = {group: _sequence_number(group) for group in _process_groups()}
    try:
        yield count
    finally:
        for group in _process_groups():
            now, then = _sequence_number(group), before.get(group, 0)
            if now is None or then is None:
                count.known = False
                continue
            issued = now - then
            if issued > 0:
                count[0] += issued
                count.group_sizes.extend([_group_size(group)] * issued)


def _group_size(group: dist.ProcessGroup) -> int:
    try:
        return int(group.size())
    except Exception:  # noqa: BLE001 - sizes are a diagnosis aid
        return -1


class Works:
    """What :func:`watching_works` saw: the ``Work`` s that ``torch.distributed``'s collectives returned inside the
    block (``launched``, those of ``async_op=True`` calls), and each call of a collective or point-to-point
    function, as ``(name, size of its group)`` (``calls``: the default group's size where it passed none; seen as
    the call starts, so a call that then raises is there)."""

    def __init__(self) -> None:
        self.launched: List[Any] = []
        self.calls: List[Tuple[str, int]] = []

    def left(self, returned: object = None) -> List[Any]:
        """The launched works, other than ``returned``, that had not completed when the block ended: what a caller
        that waits only on a returned ``Work`` reads the results of before they are written. (A wait on a
        ``Work`` is a C++ method a profile function does not see; one that completed is waited for or was fast
        enough, and its results are there.)"""
        seen: List[Any] = []
        for work in self.launched:
            if work is not returned and not any(work is w for w in seen) and not _completed(work):
                seen.append(work)
        return seen


def _completed(work: dist.Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a Work that cannot say: treat it as not completed
        return False


#: ``torch.distributed``'s point-to-point functions (its collectives are those that take ``async_op``).
_P2P = ("send", "recv", "isend", "irecv")
#: The file of ``torch.distributed``'s collectives: a ``Work`` returned from a function there is one the caller
#: launched (``async_op=True``).
_C10D_FILE = distributed_c10d.__file__


@contextlib.contextmanager
def watching_works() -> Iterator[Works]:
    """Observe, in this thread, the calls of ``torch.distributed``'s collectives inside the block and the ``Work`` s
    they return, by a profile function (``sys.setprofile``): nothing of ``torch.distributed`` is replaced or
    wrapped, so the code in the block gets PyTorch's own functions and ``Work`` objects. A profile function set
    by the code in the block itself is restored over this one when it ends."""
    works = Works()
    work_type = getattr(dist, "Work", None)
    depth = [0]  # torch.distributed frames open: the outermost is the call the block made

    def profile(frame: FrameType, event: str, arg: object) -> None:
        in_c10d = frame.f_code.co_filename == _C10D_FILE
        if event == "call" and in_c10d:
            params = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
            if depth[0] == 0 and "group" in params and ("async_op" in params or frame.f_code.co_name in _P2P):
                works.calls.append((frame.f_code.co_name, _group_size(frame.f_locals.get("group")
                                                                      or dist.group.WORLD)))
            depth[0] += 1
        elif event == "return" and in_c10d:
            depth[0] = max(0, depth[0] - 1)
            if arg is not None:
                for item in arg if isinstance(arg, list) else (arg,):
                    if work_type is not None and isinstance(item, work_type):
                        works.launched.append(item)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield works
    finally:
        sys.setprofile(previous)
