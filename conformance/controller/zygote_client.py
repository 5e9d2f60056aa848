"""The controller's handle on the zygote, the template process that forks local ranks (:mod:`conformance.ranks.zygote`).

One zygote per session (:func:`start_zygote`, :func:`close_zygote`): it imports
torch and the suite once, and :class:`conformance.controller.local_pool.RankPool` asks it
to fork each rank (:meth:`_Zygote.spawn`), whose exit status it then reads through
the zygote (:class:`_ForkedRank`, which offers the part of ``subprocess.Popen``'s
interface the pool uses). ``CONFORM_FORK_RANKS=0``, or a platform without
``fork``, makes the pool start every rank as a fresh interpreter instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Callable, Dict, List, Optional

from conformance.protocol import ZYGOTE_FORK_UNSAFE_EXIT, Msg, recv, send

__all__ = ["close_zygote", "rank_env", "start_zygote", "zygote"]


def rank_env() -> dict:
    """The environment of a rank process (and of the zygote, which imports torch for them): the
    controller's, with one OpenMP thread unless set, and unbuffered output for the rank logs."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Zygote:
    """The controller's handle on the template process that forks ranks (:mod:`conformance.ranks.zygote`)."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = rank_env()
        # Should anything the zygote imports ask torch.cuda.is_available(), it asks NVML, which leaves the
        # CUDA driver uninitialised: a child forked after cuInit cannot use CUDA.
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "conformance.ranks.zygote", str(child.fileno()), str(os.getpid())],
                                     pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        child.close()
        self.conn = Connection(parent.detach())

    def spawn(self, sock: socket.socket, out_fd: int, env: Dict[str, str]) -> "_ForkedRank":
        """Fork a rank that runs ``conformance.ranks.worker`` on (a copy of) ``sock``, its output to (a copy of) ``out_fd``."""
        send(self.conn, (Msg.SPAWN, {"env": env}))
        send_handle(self.conn, sock.fileno(), self.proc.pid)
        send_handle(self.conn, out_fd, self.proc.pid)
        return _ForkedRank(self, self._reply(Msg.PID, lambda pid: True))

    def status(self, pids: List[int]) -> Dict[int, Optional[int]]:
        send(self.conn, (Msg.STATUS, pids))
        return self._reply(Msg.STATUS, lambda answer: all(pid in answer for pid in pids))

    def _reply(self, kind: Msg, fits: Callable[[Any], bool]) -> Any:
        """The zygote's answer to the request just sent: the next message of ``kind`` whose payload ``fits``.
        Each request gets exactly one answer, in order; an answer left unread by a request that a signal
        interrupted between its send and its receive (a Ctrl-C while the pools start or close) is read here
        and passed over, so it never answers this request (a pid missing from a STATUS answer, once)."""
        while True:
            got, payload = recv(self.conn)
            if got == kind and fits(payload):
                return payload

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _ForkedRank:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface the pool uses."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote = zygote
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.status([self.pid])[self.pid]
            except (EOFError, OSError):  # the zygote is gone, and reaped its children with it
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_ZYGOTE: Optional[_Zygote] = None


#: Set once the session's zygote exited because it could not fork ranks safely: no zygote is started again.
_FORK_UNSAFE = False


def zygote() -> Optional[_Zygote]:
    """The session's zygote, started on first use; ``None`` when ranks start as fresh interpreters
    (``CONFORM_FORK_RANKS=0``, no ``fork`` on this platform, or a zygote that exited with
    :data:`~conformance.protocol.ZYGOTE_FORK_UNSAFE_EXIT`: it could not fork safely on this machine, and said
    why on stderr)."""
    global _ZYGOTE, _FORK_UNSAFE
    if os.environ.get("CONFORM_FORK_RANKS", "1") == "0" or not hasattr(os, "fork"):
        return None
    if _ZYGOTE is not None and _ZYGOTE.proc.poll() == ZYGOTE_FORK_UNSAFE_EXIT:
        _FORK_UNSAFE = True
    if _FORK_UNSAFE:
        return None
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def start_zygote() -> None:
    """Start the session's zygote now, so its imports overlap the controller's (``conform`` does this
    before pytest starts). A no-op where ranks start as fresh interpreters."""
    zygote()


def close_zygote() -> None:
    """Stop the session's zygote (its ranks are the pools' to stop). Idempotent."""
    global _ZYGOTE
    if _ZYGOTE is not None:
        _ZYGOTE.close()
        _ZYGOTE = None
