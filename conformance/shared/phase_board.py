"""A rank's current phase on a page of memory it shares with the controller, in place of one message per phase.

A check announces what it is doing (``RankContext.phase``: ``"step 3: forward/backward of the hooked
model"``) so that a rank that hangs or dies is reported with what it was doing. The controller reads the phase
only then, yet a message per phase made it wake up for every one: thousands per long run, each a system
call on the rank, a wake-up and an unpickling on the controller (about 5 % of a long run's rank time, torch
2.13 on 2 CPU cores). A local pool's rank writes its phase into a :class:`PhaseBoard` instead: a small file
in the pool's private directory that both processes map (``mmap``), so an announcement is a memory copy, and
the controller reads the last one where it needs it (:meth:`PhaseBoard.read`). torchrun's ranks, on other
machines, still send messages (:mod:`conformance.controller.remote`).

Layout: a 4-byte little-endian length, then that many bytes of UTF-8; at most :data:`BOARD_BYTES` in all, a
longer phase is cut (at a character). The writer writes the text before its length, and the controller reads
only when the rank is between cases, hung or gone, so a read never meets a write half done.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["BOARD_BYTES", "PhaseBoard"]

#: Bytes of one board: the length, then the phase's UTF-8.
BOARD_BYTES = 16384

_LENGTH_BYTES = 4


class PhaseBoard:
    """One rank's phase board, the file ``path`` mapped into this process.

    Args:
        path: the board's file; :meth:`create` makes it (the controller, before the rank starts); the rank
            opens it with ``create=False``.

    Raises:
        OSError: the file cannot be created, opened or mapped.
    """

    def __init__(self, path: str, create: bool = False):
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, BOARD_BYTES)
            self._map = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, path: str) -> "PhaseBoard":
        """A new, empty board at ``path`` (which must not exist)."""
        return cls(path, create=True)

    def write(self, text: str) -> None:
        """Make ``text`` the board's phase (``""`` clears it); a phase longer than the board is cut."""
        data = text.encode("utf-8", "replace")[:BOARD_BYTES - _LENGTH_BYTES]
        self._map[_LENGTH_BYTES:_LENGTH_BYTES + len(data)] = data
        self._map[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")

    def read(self) -> str:
        """The last phase written (``""`` when none was since the last clear); a character cut by
        :meth:`write`'s bound is dropped."""
        n = min(int.from_bytes(self._map[:_LENGTH_BYTES], "little"), BOARD_BYTES - _LENGTH_BYTES)
        return self._map[_LENGTH_BYTES:_LENGTH_BYTES + n].decode("utf-8", "ignore")

    def close(self) -> None:
        """Unmap the board (the file stays). Idempotent."""
        if not self._map.closed:
            self._map.close()
