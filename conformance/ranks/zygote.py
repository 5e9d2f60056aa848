"""A template for rank processes: imports torch and the suite once, then forks every rank from itself.

A rank started as a fresh interpreter spends about 3 s of CPU importing torch,
its FSDP and DDP modules and the suite's API modules before it can join its
process group; a run that starts pools of 2, 3 and 4 ranks on a 2-core machine
spent 13 s on that alone. The zygote imports them once (:data:`PRELOAD`), then
``fork()``s each rank: the child starts its own session (so ``killpg`` reaches
it and a terminal's Ctrl-C does not), sends its output to the rank's log (a pipe the controller reads),
takes the pool's environment and runs :func:`conformance.ranks.worker.main` on the
socket the controller passed it. Nothing in the zygote starts threads or
initialises CUDA before it forks: a child forked from a process that did cannot
run a backward pass (autograd starts a thread per GPU at its first backward and
marks every later fork bad: "Unable to handle autograd's threading in combination
with fork-based multiprocessing") nor use CUDA. The warm-up therefore runs no
backward, and after the imports the zygote checks (:func:`fork_unsafe`): where
it holds more than one thread or CUDA is initialised, it exits with
:data:`conformance.protocol.ZYGOTE_FORK_UNSAFE_EXIT` and the reason on stderr, and the controller starts
every rank as a fresh interpreter for the rest of the session.

Protocol (a ``multiprocessing.connection.Connection`` over a socketpair):

* ``(Msg.SPAWN, {"env"})`` followed by the rank's socket and the write end of its
  output pipe (each passed with ``multiprocessing.reduction.send_handle``)
  -> ``(Msg.PID, pid)``;
* ``(Msg.STATUS, [pid, ...])`` -> ``(Msg.STATUS, {pid: exit code or None})``, the
  exit code as ``subprocess.Popen.returncode`` gives it (``-N`` for signal N);
  the zygote reaps its children only here.

The zygote exits when the controller closes its end, and the kernel kills it
when the controller dies (:func:`conformance.ranks.lifeline.die_with_parent`, against
the controller pid given as the second argument). Each forked rank arms the
same signal against the zygote, so no rank outlives the pair. The pool falls
back to starting each rank as a fresh interpreter when the zygote cannot start,
and ``CONFORM_FORK_RANKS=0`` makes it do so always.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Dict, List, Optional, Tuple

import torch

from conformance.ranks import lifeline
from conformance.protocol import ZYGOTE_FORK_UNSAFE_EXIT, Msg, recv, send

#: Modules every rank imports anyway, imported once here before any fork.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "conformance.ranks.worker",
    "conformance.apis.registry",
    "conformance.ranks.checks",
    "conformance.models",
)


def _api_modules() -> Tuple[str, ...]:
    """Each hook API's built-in hooks and rank side (its models, its own checks), as the registry names them."""
    try:
        apis = importlib.import_module("conformance.apis.registry").HOOK_APIS.values()
    except Exception:  # noqa: BLE001 - a rank that needs them will raise with its own traceback
        return ()
    targets = [t for api in apis for t in (api.builtin_hooks, api.models, *api.checks.values()) if t]
    return tuple(dict.fromkeys(t.partition(":")[0] for t in targets))


def _preload() -> None:
    gc.disable()  # imports make no garbage worth a collection (as in conformance/__init__.py)
    try:
        for name in PRELOAD + _api_modules():
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a rank that needs it will raise with its own traceback
                pass
    finally:
        gc.enable()
    _warm_up()
    # What the imports made is never garbage: out of the collector's sight, a rank's first collections do not walk
    # it (the imports ran uncollected, so it all sits in the youngest generation) and write into its pages, each
    # a copy-on-write fault in every forked rank.
    gc.freeze()


def _warm_up() -> None:
    """One SGD step of a small model on the CPU, no process group: what every rank's first case would
    otherwise pay for in each fresh rank (the first ``torch.optim`` step imports ``torch._dynamo``, about
    2 s of CPU), paid once here. Each hook gets ranks of its own, forked from here, so without this every
    hook's first case at every world size would pay it.

    No backward pass: on a machine with a GPU, autograd's first backward starts a thread per device
    (``Engine::start_device_threads``) and marks every later ``fork()`` bad, so each forked rank's first
    backward would raise. The gradients are set by hand instead. Starts no thread, initialises no device."""
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model(torch.ones(2, 4))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        optim.step()
        optim.zero_grad(set_to_none=True)
    except Exception:  # noqa: BLE001 - a rank that needs it will raise with its own traceback
        pass


def fork_unsafe() -> Optional[str]:
    """Why ranks forked from this process now could not run a case, or ``None`` where forking is safe.

    Unsafe: more than one thread (a forked child gets only the calling thread, so a lock another thread
    held stays locked, and autograd's per-device threads mark the fork bad), or CUDA initialised here
    (``torch.cuda.is_initialized()``: a forked child cannot use it). Threads are counted from
    ``/proc/self/task`` where it exists (Linux), else from :mod:`threading`."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    reasons = []
    if threads > 1:
        reasons.append(f"it runs {threads} threads after importing torch and the suite")
    if torch.cuda.is_initialized():
        reasons.append("CUDA was initialised while importing torch and the suite")
    return "; ".join(reasons) or None


def _child(conn: Connection, fd: int, out_fd: int, env: Dict[str, str], zygote_pid: int) -> None:
    """In the forked rank: own session, output to the controller's pipe, the pool's environment, then the worker."""
    code = 1
    try:
        conn.close()
        lifeline.die_with_parent(zygote_pid)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        from conformance.ranks import worker  # late: in the rank, whose log shows an import error, not the zygote's

        code = worker.main([str(fd), str(zygote_pid)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(exits: Dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    conn = Connection(socket.socket(fileno=int(argv[0])).detach())
    if len(argv) > 1:
        lifeline.die_with_parent(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides when ranks stop
    _preload()
    unsafe = fork_unsafe()
    if unsafe is not None:
        print(f"zygote: cannot fork ranks safely: {unsafe}; ranks start as fresh interpreters", file=sys.stderr,
              flush=True)
        os._exit(ZYGOTE_FORK_UNSAFE_EXIT)
    exits: Dict[int, int] = {}
    while True:
        try:
            kind, payload = recv(conn)
        except (EOFError, OSError):
            # Nothing to clean up: skip the interpreter's teardown of torch (most of a second).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if kind == Msg.SPAWN:
            fd = recv_handle(conn)
            out_fd = recv_handle(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            zygote_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                _child(conn, fd, out_fd, payload["env"], zygote_pid)
            os.close(fd)
            os.close(out_fd)
            send(conn, (Msg.PID, pid))
        elif kind == Msg.STATUS:
            _reap(exits)
            send(conn, (Msg.STATUS, {pid: exits.get(pid) for pid in payload}))


if __name__ == "__main__":
    sys.exit(main())
