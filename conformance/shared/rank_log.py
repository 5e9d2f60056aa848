"""One rank's output (its stdout and stderr), read by the controller from a pipe, with a byte limit.

A rank writes to a pipe; a daemon thread in the controller reads it as it
comes (:class:`RankLog`). The controller wants one thing from that output: what
the rank printed during the case, for the failure text (and the stack that
faulthandler writes when a case hangs). So the log keeps the output since the
last :meth:`RankLog.mark` (the start of a case), at most ``limit_bytes`` of it:
the first half and the last half, the bytes in between counted and dropped.
A hook that prints 10 MB per call then costs a bounded amount of memory and no
disk at all, and a failure says how much of the output it leaves out
(``... N bytes of rank output cut ...``).

The thread never blocks the rank for long (it reads whatever is in the pipe),
and keeps working while the controller's main thread waits on a case.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Optional

__all__ = ["RankLog", "cut_note"]

#: Seconds between the reader thread's checks that the log was closed.
_POLL_S = 0.2


def cut_note(n_bytes: int) -> str:
    """The line that stands for ``n_bytes`` of output left out."""
    return f"... {n_bytes} bytes of rank output cut ..."


class RankLog:
    """Reads one rank's output pipe from a daemon thread, keeping at most ``limit_bytes`` per case.

    Args:
        fd: the read end of the rank's output pipe; the log owns it (closes it
            at end of file or :meth:`close`).
        limit_bytes: the most output kept since the last :meth:`mark`: the first
            ``limit_bytes // 2`` bytes and the last ``limit_bytes - limit_bytes // 2``.

    Attributes:
        total_bytes: bytes the rank wrote since the last :meth:`mark`, kept or not.
    """

    def __init__(self, fd: int, limit_bytes: int):
        if limit_bytes < 2:
            raise ValueError(f"limit_bytes must be at least 2, got {limit_bytes}")
        self._fd: Optional[int] = fd
        os.set_blocking(fd, False)
        self._head_limit = limit_bytes // 2
        self._tail_limit = limit_bytes - self._head_limit
        self._lock = threading.Lock()
        self._closed = False
        self._reset()
        self._thread = threading.Thread(target=self._pump, name="conformance-rank-log", daemon=True)
        self._thread.start()

    def _reset(self) -> None:
        self._head = bytearray()
        self._tail = bytearray()
        self._cut = 0
        self.total_bytes = 0

    # -- the reader thread ---------------------------------------------------------
    def _pump(self) -> None:
        poller = select.poll()
        with self._lock:
            if self._fd is None:
                return
            poller.register(self._fd, select.POLLIN | select.POLLHUP)
        while not self._closed:
            if poller.poll(_POLL_S * 1000) and not self._read_available():
                return
        with self._lock:
            self._close_fd()

    def _read_available(self) -> bool:
        """Read what is in the pipe now; False at end of file (the fd is then closed)."""
        with self._lock:
            while self._fd is not None:
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    return True
                except OSError:
                    data = b""
                if not data:
                    self._close_fd()
                    return False
                self._keep(data)
            return False

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _keep(self, data: bytes) -> None:
        self.total_bytes += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            over = len(self._tail) - self._tail_limit
            if over > 0:
                del self._tail[:over]
                self._cut += over

    # -- the controller's side -------------------------------------------------------
    def mark(self) -> None:
        """Start a new case: drop what was kept (after reading what the pipe holds now)."""
        self._read_available()
        with self._lock:
            self._reset()

    def excerpt(self, head_chars: int, tail_chars: int) -> str:
        """The output since the last :meth:`mark`, as text: all of it if it fits in ``head_chars +
        tail_chars`` bytes, else its first ``head_chars`` and last ``tail_chars`` bytes around a
        :func:`cut_note` that counts every byte left out (by this call or by the limit).

        Reads what the pipe holds first, so output written before the rank answered is included.
        """
        self._read_available()
        with self._lock:
            if not self._cut and len(self._head) + len(self._tail) <= head_chars + tail_chars:
                return (bytes(self._head) + bytes(self._tail)).decode("utf-8", "replace")
            whole = bytes(self._head) + (bytes(self._tail) if not self._cut else b"")
            first = whole[:head_chars] if head_chars else b""
            last = (bytes(self._tail) if self._cut else whole)[-tail_chars:] if tail_chars else b""
            cut = self.total_bytes - len(first) - len(last)
        text = f"{cut_note(cut)}\n" + last.decode("utf-8", "replace")
        if first:
            text = first.decode("utf-8", "replace") + f"\n{text}"
        return text

    def close(self) -> None:
        """Stop reading (the thread closes the pipe within a fraction of a second). Idempotent."""
        self._closed = True
