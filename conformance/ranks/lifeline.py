"""A rank (or the zygote) ends by itself when the process that started it is gone.

Pool processes run in sessions of their own, so a terminal's Ctrl-C never
reaches them, and a controller that dies (SIGKILL, a crash, the kernel's
out-of-memory killer) cannot stop them. Two lifelines, so that neither alone has to be perfect:

* :func:`die_with_parent`: Linux's parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills this process the
  moment its parent exits, whatever the process is doing (even stuck in C code
  that holds the GIL). The zygote sets it against the controller, and every
  rank it forks against the zygote, so the chain controller -> zygote -> rank
  falls together. A rank started as a fresh interpreter sets it against the
  controller directly.
* :func:`exit_when_closed`: a daemon thread that watches the controller's
  socket and ends the process with ``os._exit`` when the controller's end is
  closed (every copy of it, so only when the controller has gone or let the
  rank go), or the parent changes. It works where ``prctl`` does not (another
  OS) and needs only that the GIL is released now and then, which a rank stuck
  in a hook's ``sleep``, ``Future.wait`` or collective does.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from typing import Optional

# Exit code of a process that ended because its controller was gone (the controller tells it from a hook's own exit).
from conformance.protocol import LOST_CONTROLLER_EXIT_CODE

__all__ = ["die_with_parent", "exit_when_closed"]

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1
#: Seconds between the watchdog's checks of the parent pid (the socket is watched continuously).
_PARENT_POLL_S = 1.0


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    Args:
        parent_pid: the pid the parent had when this process started; if the
            parent is already gone (this process was re-parented before the
            call), the process exits at once with :data:`LOST_CONTROLLER_EXIT_CODE`.
        sig: the signal to receive; SIGKILL by default, which no hook can block.

    Returns:
        True when the signal is armed; False where ``prctl`` is not available
        (not Linux, no libc), in which case :func:`exit_when_closed` is the only lifeline.

    The signal fires when the parent *thread* that forked this process exits,
    so a parent must start pool processes from a thread that lives as long as
    it (the controller and the zygote use their main thread).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The C library already in this process (``CDLL(None)``): ctypes.util.find_library runs ``ldconfig -p``
        # in a subprocess, twice, in every rank.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(LOST_CONTROLLER_EXIT_CODE)
    return True


def exit_when_closed(fd: int, parent_pid: Optional[int] = None, what: str = "the controller") -> threading.Thread:
    """Start a daemon thread that ends this process when the peer of socket ``fd`` closes it.

    Args:
        fd: a connected stream socket whose peer is the controller. The thread
            only polls it for a hang-up (``POLLRDHUP``/``POLLHUP``), never reads
            it, so the main thread's messages are left alone.
        parent_pid: if given, the process also ends when its parent is no
            longer this pid (checked every second).
        what: names the peer in the line written to stderr (the rank's log).

    The process ends with ``os._exit(LOST_CONTROLLER_EXIT_CODE)``, even when
    the main thread is stuck in a hook: no cleanup runs, which is the point.
    """

    def watch() -> None:
        rdhup = getattr(select, "POLLRDHUP", 0)
        poller = select.poll() if hasattr(select, "poll") else None
        if poller is not None:
            poller.register(fd, rdhup | select.POLLHUP | select.POLLERR)
        while True:
            gone = False
            if poller is not None:
                events = poller.poll(_PARENT_POLL_S * 1000)
                if any(ev & select.POLLNVAL for _, ev in events):
                    # This process closed the socket itself (it is shutting down): nothing left to watch.
                    poller = None
                    continue
                gone = any(ev & (rdhup | select.POLLHUP | select.POLLERR) for _, ev in events)
            else:  # pragma: no cover - no poll(): the parent check alone
                threading.Event().wait(_PARENT_POLL_S)
            if not gone and parent_pid is not None and os.getppid() != parent_pid:
                gone = True
            if gone:
                try:
                    os.write(2, f"\n[conformance] {what} is gone: pid {os.getpid()} exits\n".encode())
                finally:
                    os._exit(LOST_CONTROLLER_EXIT_CODE)

    thread = threading.Thread(target=watch, name="conformance-lifeline", daemon=True)
    thread.start()
    return thread
