#!/usr/bin/env python3
"""Starting a pool's ranks: the suite's zygote, multiprocessing's forkserver, fresh interpreters.

Issue 46 (item 7) asks whether the standard library's forkserver, with its modules preloaded, would do the
zygote's job (``conformance/ranks/zygote.py``) as fast. Each way starts a :class:`RankPool` of ``N`` gloo CPU
ranks and waits until every rank has joined its process group and said ``READY`` (what ``RankPool.start`` waits
for before a pool's first case); only the way its processes come to be differs:

* **zygote**: the suite's own (the default). Its start (the template interpreter imports torch and the suite,
  warms up, checks it can fork safely) is timed apart, up to its first answer; then a first and a second pool.
* **forkserver**: ``multiprocessing.get_context("forkserver")`` with ``set_forkserver_preload`` of the modules
  the zygote imports (``zygote.PRELOAD`` and each hook API's modules). Each rank is a ``Process`` whose arguments, the
  rank's socket and the write end of its log pipe, travel as multiprocessing pickles them (``SCM_RIGHTS``), and
  whose target does in the child what the zygote's child does (``zygote._child``: own session, log, the pool's
  environment, then ``worker.main``, which joins the group and says ``READY`` over that socket). The pool's
  ``zygote`` is swapped for an adapter (``Process.exitcode`` as the pool reads a forked rank's exit status), so
  the pool code timed is the same. The server's start is timed apart (up to a no-op child's exit).
* **forkserver+warm**: the same, but the server preloads only this script (as a module), whose import there does what the
  zygote does before its first fork (``zygote._preload``: the imports, the warm-up step that spares each pool's
  first case the import of ``torch._dynamo``, ``gc.freeze``; then the fork-safety check): what ``set_forkserver_preload``
  alone does not do, and what switching would have to add.
* **fresh**: every rank a fresh interpreter (``CONFORM_FORK_RANKS=0``), for scale; no template, so a
  second pool costs what the first does.

For each world size and repetition the template is stopped and started again, so that every repetition has a
cold start, a first pool and a second pool (template warm). The ways take turns within a repetition, so a
change in the machine's load falls on all of them. Prints median and min of each figure; no pass or fail.

Usage::

    python benchmarks/rank_start.py [--world-sizes 2 4] [--repeat 3] [--json]
"""

# Every forkserver child runs this script's top level again (as ``__mp_main__``: Python 3.11's forkserver never
# preloads ``__main__``, see docs/speed.md): only the standard library at module level, but for the
# "forkserver+warm" server's own preload below.
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

WAYS = ("zygote", "forkserver", "forkserver+warm", "fresh")

#: Set while the "forkserver+warm" way starts its server, which preloads this script as the module ``rank_start``
#: (its folder on ``PYTHONPATH`` meanwhile): its import there then does what the zygote does before its first fork
#: (imports, warm-up step, ``gc.freeze``, fork-safety check).
_WARM_ENV = "RANK_START_FORKSERVER_WARM"

if __name__ == "rank_start" and os.environ.get(_WARM_ENV) == "1":  # in the forkserver, before it forks
    from conformance.protocol import ZYGOTE_FORK_UNSAFE_EXIT
    from conformance.ranks import zygote as _zygote

    _zygote._preload()
    if _zygote.fork_unsafe() is not None:  # the controller never sees this exit code (see docs/speed.md)
        print(f"forkserver: cannot fork ranks safely: {_zygote.fork_unsafe()}", file=sys.stderr, flush=True)
        os._exit(ZYGOTE_FORK_UNSAFE_EXIT)


# -- the forkserver way ------------------------------------------------------------------------------------------
class _NoConnection:
    """What ``zygote._child`` closes first (the zygote's connection to the controller): a forkserver child has none."""

    def close(self) -> None:
        pass


def _forkserver_rank(sock: Any, out: Any, env: Dict[str, str]) -> None:
    """In the forkserver's child: what the zygote's child does (``zygote._child``), on the socket and log pipe that
    multiprocessing passed. Ends the process (``os._exit``) with the worker's exit code."""
    from conformance.ranks import zygote

    fd = sock.detach()
    out_fd = os.dup(out.fileno())
    out.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    zygote._child(_NoConnection(), fd, out_fd, env, os.getppid())


def _noop() -> None:
    pass


class _ForkserverRank:
    """A rank forked by the forkserver, with the part of ``subprocess.Popen``'s interface the pool uses."""

    def __init__(self, proc: Any):
        self.proc = proc
        self.pid = proc.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.proc.exitcode  # the forkserver reaped it and wrote the code to our pipe
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _ForkserverSpawner:
    """Stands in for the pool's zygote (``spawn(sock, out_fd, env)``), forking each rank from the forkserver."""

    def __init__(self, ctx: Any):
        self.ctx = ctx

    def spawn(self, sock: Any, out_fd: int, env: Dict[str, str]) -> _ForkserverRank:
        from multiprocessing.connection import Connection

        out = Connection(os.dup(out_fd), readable=False)  # a Connection pickles as its fd (DupFd)
        try:
            # Not daemonic: a daemonic process may not start processes of its own (a hook's DataLoader workers).
            proc = self.ctx.Process(target=_forkserver_rank, args=(sock, out, env), daemon=False)
            proc.start()
        finally:
            out.close()
        return _ForkserverRank(proc)


def _forkserver_env() -> Dict[str, str]:
    """What the zygote's own environment adds to the controller's (``zygote_client._Zygote``): the forkserver
    takes the controller's ``os.environ`` as it is when the server starts, so these are set there meanwhile."""
    from conformance.controller.zygote_client import rank_env

    env = rank_env()
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return env


def _forkserver_preload() -> List[str]:
    from conformance.ranks import zygote

    return [*zygote.PRELOAD, *zygote._api_modules()]


def _stop_forkserver() -> None:
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # private; what CPython's own tests use to stop the server


# -- timing --------------------------------------------------------------------------------------------------------
def _time_pool(world_size: int, kind: Callable[[Any], bool], what: str) -> float:
    """Seconds from ``RankPool.start`` to every rank ``READY``; the pool is closed after (not timed)."""
    from conformance.controller.local_pool import RankPool
    from conformance.controller.pools import PoolConfig

    pool = RankPool(PoolConfig(world_size=world_size, backend="gloo", device="cpu", start_timeout_s=300.0))
    try:
        started = time.perf_counter()
        pool.start()
        elapsed = time.perf_counter() - started
        if not all(kind(p) for p in pool._procs):
            raise RuntimeError(f"the {what} pool's ranks did not start the {what} way: {pool._procs}")
        return elapsed
    finally:
        pool.close()


def zygote_round(world_size: int) -> Dict[str, float]:
    from conformance.controller import zygote_client

    os.environ.pop("CONFORM_FORK_RANKS", None)
    zygote_client.close_zygote()
    zygote_client._FORK_UNSAFE = False
    forked = lambda p: isinstance(p, zygote_client._ForkedRank)  # noqa: E731
    try:
        started = time.perf_counter()
        zygote_client.zygote().status([])  # answered once the zygote has imported, warmed up and checked
        template = time.perf_counter() - started
        first = _time_pool(world_size, forked, "zygote")
        second = _time_pool(world_size, forked, "zygote")
    finally:
        zygote_client.close_zygote()
    return {"template_s": template, "first_s": first, "second_s": second}


def forkserver_round(world_size: int, warm: bool = False) -> Dict[str, float]:
    import multiprocessing

    from conformance.controller import local_pool as pool_mod

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_start"] if warm else _forkserver_preload())
    _stop_forkserver()
    saved_env = dict(os.environ)
    spawner = _ForkserverSpawner(ctx)
    plain = pool_mod._session_zygote
    pool_mod._session_zygote = lambda: spawner
    forked = lambda p: isinstance(p, _ForkserverRank)  # noqa: E731
    try:
        os.environ.update(_forkserver_env())
        if warm:
            os.environ[_WARM_ENV] = "1"
            here = os.path.dirname(os.path.abspath(__file__))
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, _REPO, os.environ.get("PYTHONPATH")) if p)
        started = time.perf_counter()
        probe = ctx.Process(target=_noop)
        probe.start()  # starts the server; returns once it forked (after its preload)
        probe.join()
        template = time.perf_counter() - started
        os.environ.clear()
        os.environ.update(saved_env)
        first = _time_pool(world_size, forked, "forkserver")
        second = _time_pool(world_size, forked, "forkserver")
    finally:
        pool_mod._session_zygote = plain
        os.environ.clear()
        os.environ.update(saved_env)
        _stop_forkserver()
    return {"template_s": template, "first_s": first, "second_s": second}


def fresh_round(world_size: int) -> Dict[str, float]:
    from conformance.controller import zygote_client

    os.environ["CONFORM_FORK_RANKS"] = "0"
    fresh = lambda p: isinstance(p, subprocess.Popen)  # noqa: E731
    try:
        first = _time_pool(world_size, fresh, "fresh")
    finally:
        os.environ.pop("CONFORM_FORK_RANKS", None)
        zygote_client.close_zygote()
    return {"first_s": first}


ROUNDS = {"zygote": zygote_round, "forkserver": forkserver_round,
          "forkserver+warm": lambda ws: forkserver_round(ws, warm=True), "fresh": fresh_round}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "(unknown)"


def _fmt(values: List[float]) -> str:
    return f"{statistics.median(values):5.2f} / {min(values):5.2f}" if values else "-"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each way and world size (default: 3)")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON line too")
    args = parser.parse_args(argv)

    load_before = _load()
    began = time.perf_counter()
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {str(ws): {w: [] for w in WAYS} for ws in args.world_sizes}
    for _ in range(args.repeat):
        for ws in args.world_sizes:
            for way in WAYS:
                runs[str(ws)][way].append(ROUNDS[way](ws))
    total = time.perf_counter() - began

    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; load average (1, 5, 15 min) "
          f"{load_before} before, {_load()} after; {total:.0f} s in all")
    print("seconds to every rank READY, median / min of {} repetitions".format(args.repeat))
    print("  (template: the zygote or forkserver from cold to its first answer; first pool: right after it; "
          "second pool: template warm; cold total: template + first pool, medians)")
    for ws in args.world_sizes:
        print(f"world size {ws}:")
        print(f"  {'way':<16} {'template':>15} {'first pool':>15} {'second pool':>15} {'cold total':>11}")
        for way in WAYS:
            got = runs[str(ws)][way]
            template = [r["template_s"] for r in got if "template_s" in r]
            first = [r["first_s"] for r in got]
            second = [r["second_s"] for r in got if "second_s" in r]
            cold = (statistics.median(template) if template else 0.0) + statistics.median(first)
            later = _fmt(second) if second else "(as the first)"
            print(f"  {way:<16} {_fmt(template):>15} {_fmt(first):>15} {later:>15} {cold:>11.2f}")
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "python": sys.version.split()[0], "load_before": load_before,
                          "load_after": _load(), "total_s": total, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
