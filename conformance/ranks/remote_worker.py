"""The rank side under torchrun: ``python -m conformance.worker --controller HOST:PORT``.

torchrun (``torch.distributed.elastic``) starts this on every node, one process
per rank, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. Each rank:

1. connects to the controller (``conform --listen HOST:PORT``) and proves it
   knows the shared secret (:mod:`conformance.shared.remote_link`);
2. says who it is (``(Msg.JOIN, {...})``) and gets the run's backend, device and
   hook specs (``(Msg.HELLO, {...})``);
3. fingerprints its clean process state, loads the hook's spec, joins the
   process group from torchrun's environment (``env://`` rendezvous), and
   serves cases with the local pool's :class:`conformance.ranks.worker._Worker` loop;
4. when the controller moves on to the next hook (``(Msg.REHOST, None)``), it
   replaces itself with a fresh interpreter running the same command
   (``os.execv``: the same pid, so torchrun's agent sees nothing and spends no
   restart), which connects again: no process runs two hooks' code.

Containment: a watchdog thread reads every message from the controller. When
the connection closes (the controller gave up on a hung or broken case, or it
died) it ends the process at once with ``os._exit``, even while the main
thread is blocked in a collective or inside a hook; torchrun's agent then
restarts the worker group (``--max-restarts``) and the new ranks connect again.
The watchdog also answers the controller's requests for the rank's Python
stacks (``faulthandler``) and its recent output, which the rank keeps a copy of
while it goes on to torchrun's own output.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import pickle
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import AuthenticationError, Connection
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from conformance.shared.rank_log import RankLog
from conformance.shared.remote_link import LinkError, connect, parse_address, read_authkey
from conformance.protocol import LOST_CONTROLLER_EXIT_CODE, Msg, recv, send
from conformance.ranks import lifeline
from conformance.ranks.worker import _Worker, join_process_group
from conformance.ranks.zygote import PRELOAD

#: Exit code when the controller closes the connection (the local ranks' code for it). Any
#: non-zero code makes torchrun's agent restart the worker group while restarts remain.
EXIT_CONTROLLER_CLOSED = LOST_CONTROLLER_EXIT_CODE
#: Exit code for a usage error (not under torchrun, no secret, a bad address, a refused join).
EXIT_USAGE = 2
#: Seconds a first start retries connecting (torchrun may start before the controller).
DEFAULT_CONNECT_TIMEOUT_S = 300.0
#: Seconds a restarted rank retries: the controller listened before, so a refusal now
#: means it ended the run, and the rank exits 0 (its work is done) instead of making
#: torchrun restart it again.
RESTART_CONNECT_TIMEOUT_S = 15.0
#: Seconds the copying thread gets to pass a faulthandler dump into the kept output.
STACK_FLUSH_S = 0.3

#: torchrun's variables that this module needs, set by torch.distributed.elastic's agent.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class _KeptOutput:
    """Copies this process's file descriptors 1 and 2 to where they went before, and into a :class:`RankLog`.

    The local pool's controller reads each rank's output through a
    :class:`conformance.shared.rank_log.RankLog`; a rank on another node keeps its own
    the same way, so a failure shows the same excerpt (head, tail, and the
    ``... N bytes of rank output cut ...`` note) whichever launcher started it,
    while torchrun still gets every byte.
    """

    def __init__(self, limit_bytes: int) -> None:
        log_read, self._log_write = os.pipe()
        self.log = RankLog(log_read, limit_bytes)
        self._lock = threading.Lock()
        self._originals: Dict[int, int] = {}
        for fd in (1, 2):
            original = self._originals[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            threading.Thread(target=self._copy, args=(read_end, original), daemon=True,
                             name=f"conformance-output-{fd}").start()

    def restore(self) -> None:
        """Point file descriptors 1 and 2 where they went before (for an ``exec``, whose new image has no
        copying thread)."""
        for fd, original in self._originals.items():
            os.dup2(original, fd)

    def _copy(self, read_end: int, original: int) -> None:
        while True:
            data = os.read(read_end, 65536)
            if not data:
                return
            try:
                os.write(original, data)
            except OSError:
                pass
            with self._lock:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._log_write, view):]


class _ControllerLink:
    """The connection to the controller, read by a watchdog thread; what ``protocol.send``/``recv`` take.

    The watchdog exits the process (``os._exit(EXIT_CONTROLLER_CLOSED)``) when
    the connection closes, answers ``(Msg.STACKS, None)`` and ``(Msg.OUTPUT, None)``
    itself, and queues every other message for the main thread.
    """

    def __init__(self, conn: Connection):
        self._conn = conn
        #: This rank's output (a RankLog), set once the controller's hello gave the log limit.
        self.output: Any = None
        self._send_lock = threading.Lock()
        self._inbox: "queue.Queue[bytes]" = queue.Queue()
        self._finished = False  # the controller said SHUTDOWN or REHOST: a closed connection is then the normal end
        threading.Thread(target=self._watch, daemon=True, name="conformance-controller-watchdog").start()

    def send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            self._conn.send_bytes(data)

    def recv_bytes(self) -> bytes:
        return self._inbox.get()

    def _watch(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                if self._finished:
                    return
                print("conformance: the controller closed the connection; this rank exits so that torchrun can "
                      "restart the worker group", file=sys.stderr, flush=True)
                os._exit(EXIT_CONTROLLER_CLOSED)
            kind, payload = pickle.loads(data)
            if kind == Msg.REFUSED:
                print(f"error: the controller refused this rank: {payload}", file=sys.stderr, flush=True)
                os._exit(EXIT_USAGE)
            # The same excerpts as the local pool takes from its RankLog (pool.RankPool.run, _dump_stacks).
            if kind == Msg.STACKS:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                time.sleep(STACK_FLUSH_S)
                send(self, (Msg.STACK, without_own_threads(self.output.excerpt(0, 6000) if self.output else "")))
            elif kind == Msg.OUTPUT:
                send(self, (Msg.OUTPUT, self.output.excerpt(1000, 2000) if self.output else ""))
            else:
                if kind == Msg.CASE and self.output is not None:
                    self.output.mark()
                elif kind in (Msg.SHUTDOWN, Msg.REHOST):
                    self._finished = True
                self._inbox.put(data)


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
_OWN_FRAME = re.compile(r"remote_worker\.py\", line \d+ in (_watch|_copy)$")


def without_own_threads(text: str) -> str:
    """``text`` without the faulthandler blocks of this module's own threads (watchdog, output copies).

    A local rank's dump shows the threads of the check alone; so does this one.
    """
    out: List[str] = []
    block: Optional[List[str]] = None

    def keep(lines: List[str]) -> List[str]:
        own = any(_OWN_FRAME.search(ln) for ln in lines)
        return [] if own else lines

    for line in text.splitlines(keepends=True):
        if _THREAD_HEADER.match(line.rstrip("\n")):
            out += keep(block or [])
            block = [line]
            continue
        if block is not None:
            if line.startswith("  ") or not line.strip():  # a frame, or the blank line that ends the block
                block.append(line)
                if line.strip():
                    continue
            out += keep(block)
            block = None
            if not line.strip():
                continue
        out.append(line)
    return "".join(out + keep(block or []))


def torchrun_env(env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """What this rank reports when it joins: torchrun's variables, the host, the pid.

    Raises:
        LinkError: a variable torchrun sets is missing (not started by torchrun).
    """
    env = os.environ if env is None else env
    missing = [name for name in TORCHRUN_ENV if not env.get(name)]
    if missing:
        raise LinkError(f"{', '.join(missing)} not set: 'python -m conformance.worker --controller HOST:PORT' runs "
                        "under torchrun, which sets them, e.g. torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend "
                        "c10d --rdzv-endpoint NODE0:29500 -m conformance.worker --controller HOST:PORT")
    return {
        "rank": int(env["RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "group_rank": int(env.get("GROUP_RANK", "0")),
        "master": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "max_restarts": int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        "run_id": env.get("TORCHELASTIC_RUN_ID", ""),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def _warm_up() -> None:
    """Import what every case needs before the rank says it is ready, as the local pool's zygote does.

    A case's timeout should measure the hook, not a fresh interpreter importing
    FSDP and ``torch._dynamo`` (which the first ``torch.optim`` optimizer pulls
    in): several seconds on a busy node, longer than a short ``--case-timeout``.
    """
    for name in (*PRELOAD, "torch._dynamo"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a case that needs it raises with its own traceback
            pass


def _start(worker: _Worker, link: _ControllerLink, hello: Dict[str, Any]) -> None:
    """Join torchrun's process group and make ``worker`` ready for cases (as ``_Worker.start`` does locally),
    after :meth:`~conformance.ranks.worker._Worker.prepare` and the hook's spec were loaded."""
    timeout = timedelta(seconds=hello["pg_timeout_s"])
    # torchrun's env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), under a key prefix
    # that is new for every start of the pool. With the c10d rendezvous, the agents share one TCPStore
    # across restarts and the ranks' keys are not isolated per restart (pytorch/pytorch#135712 and
    # #167288): a restarted group would read its predecessor's addresses and fail to connect.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"conformance/{hello['generation']}/", store)
    kwargs: Dict[str, Any] = dict(backend=worker.backend, store=store, rank=rank, world_size=world_size,
                                  timeout=timeout)
    if worker.backend == "nccl":
        kwargs["device_id"] = worker.device
    join_process_group(kwargs)
    if dist.get_rank() != worker.rank or dist.get_world_size() != worker.world_size:
        raise RuntimeError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, but torchrun "
                           f"set RANK={worker.rank} WORLD_SIZE={worker.world_size}")
    worker.joined(link)
    send(link, (Msg.READY, worker.ready_info()))


def _exec_afresh(kept: Optional[_KeptOutput]) -> None:
    """Replace this process with a fresh interpreter running the same command (``os.execv``): the next hook's
    cases get a process that never ran the last hook's code. The pid stays, so torchrun's agent sees nothing
    and spends no restart; the new image connects to the controller again."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if kept is not None:
        kept.restore()
    argv = list(getattr(sys, "orig_argv", []) or [sys.executable, "-m", "conformance.worker", *sys.argv[1:]])
    os.execv(sys.executable, [sys.executable, *argv[1:]])


def main(argv: Optional[list] = None) -> int:
    """Serve cases for the controller at ``--controller HOST:PORT`` until it says ``shutdown``.

    Returns 0 after a ``shutdown`` (or when a restarted rank finds the
    controller gone), 1 when a hook spec or the process group fails here,
    :data:`EXIT_USAGE` on a usage error; exits with
    :data:`EXIT_CONTROLLER_CLOSED` when the controller closes the connection.
    """
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m conformance.worker",
        description="A conformance rank started by torchrun: connects to 'conform --listen HOST:PORT'. The shared "
                    "secret comes from CONFORM_AUTHKEY_FILE (a file only you can read) or CONFORM_AUTHKEY.")
    parser.add_argument("--controller", required=True, metavar="HOST:PORT",
                        help="the address the controller listens on (its --listen)")
    parser.add_argument("--connect-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"seconds to retry reaching the controller (default {DEFAULT_CONNECT_TIMEOUT_S:g}; "
                             f"{RESTART_CONNECT_TIMEOUT_S:g} after a restart)")
    args = parser.parse_args(argv)
    try:
        address = parse_address(args.controller, "--controller")
        authkey = read_authkey()
        info = torchrun_env()
    except LinkError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    restarted = info["restart_count"] > 0
    timeout = args.connect_timeout
    if timeout is None:
        timeout = RESTART_CONNECT_TIMEOUT_S if restarted else DEFAULT_CONNECT_TIMEOUT_S
    try:
        conn = connect(address, authkey, timeout)
    except AuthenticationError as exc:
        print(f"error: the controller at {args.controller} refused this rank's shared secret ({exc}): use the same "
              "CONFORM_AUTHKEY_FILE / CONFORM_AUTHKEY on every node as on the controller", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except ConnectionError as exc:
        if restarted:
            print(f"conformance: {exc}; the controller ended the run, so this rank exits", file=sys.stderr, flush=True)
            return 0
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE

    lifeline.die_with_parent(os.getppid())  # a torchrun agent killed with SIGKILL cannot stop its workers
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
    sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    link = _ControllerLink(conn)
    send(link, (Msg.JOIN, info))
    kind, hello = recv(link)
    if kind == Msg.SHUTDOWN:
        send(link, (Msg.BYE, None))
        return 0
    kept = _KeptOutput(hello["log_limit_bytes"])
    link.output = kept.log
    worker = _Worker(link, {"rank": info["rank"], "world_size": info["world_size"], "backend": hello["backend"],
                            "device": hello["device"]})
    try:
        _warm_up()
        worker.prepare(info["local_rank"])  # the clean fingerprint, before the hook's module is imported
    except BaseException:  # noqa: BLE001 - reported to the controller
        send(link, (Msg.FAILED, traceback.format_exc()))
        return 1
    problem = worker.load_specs(hello.get("specs", ()))
    if problem is not None:
        send(link, (Msg.SPEC_FAILED, problem))
        return 1
    try:
        _start(worker, link, hello)
    except BaseException:  # noqa: BLE001 - reported to the controller
        send(link, (Msg.FAILED, traceback.format_exc()))
        return 1
    worker.loop()
    if worker.rehost:  # the next hook's cases: a fresh process image under the same pid
        _exec_afresh(kept)
    return 0
