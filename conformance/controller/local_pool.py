"""The controller side of the rank pool.

One :class:`RankPool` is ``world_size`` worker processes (``conformance.ranks.worker``)
joined in one process group, started once and reused for every case: PyTorch's
own ``MultiProcessTestCase`` spawns and initializes fresh processes per test,
which costs seconds; a round trip through the pool costs milliseconds.

Containment: a case that hangs or kills a rank does not end the session. The
controller waits at most the case timeout, asks each unfinished rank for its
Python stack (``SIGUSR1`` -> ``faulthandler``), kills the pool, reports what each
rank was doing and starts a fresh pool for the next case. Rendezvous uses a
``FileStore`` in a private temporary directory, so no TCP port is reserved and
a port already in use cannot break start-up.

Each rank's stdout and stderr go through a pipe to a :class:`~conformance.shared.rank_log.RankLog`
in the controller, which keeps a bounded part of each case's output. A pool runs
the cases of one hook (:meth:`conformance.controller.runner.Runner.serve`). A rank whose
resident memory grew by more than ``PoolConfig.memory_growth_bytes`` since the
pool was ready (over the hook's cases so far), or that reports its process state
changed (:mod:`conformance.ranks.process_state`), gets the pool restarted after the
case, and the result names it: the hook is blamed in its own case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from conformance.controller.pools import (PoolConfig, PoolStartError, SpecLoadError, gather_outcomes, in_step,
                                          memory_grown)
from conformance.shared.phase_board import PhaseBoard
from conformance.shared.rank_log import RankLog
from conformance.controller.zygote_client import rank_env, zygote as _session_zygote
from conformance.protocol import Case, CaseResult, Msg, RankOutcome, recv, send, send_all

__all__ = ["RankPool", "pool_env"]

#: Seconds a rank gets to write its stack after SIGUSR1.
STACK_DUMP_WAIT_S = 0.5


def pool_env(config: PoolConfig) -> Dict[str, str]:
    """The environment of a local pool's ranks (:func:`~conformance.controller.zygote_client.rank_env`), and:

    * gloo on Linux: ``GLOO_SOCKET_IFNAME=lo`` unless set (the pool never leaves the machine);
    * CPU ranks: ``CUDA_VISIBLE_DEVICES=""``, so that ``torch.cuda.is_available()`` is ``False`` in them as
      on a machine without a GPU. A one-GPU machine runs its cross-rank cases in CPU pools, and PyTorch's
      own hooks take CUDA paths whenever CUDA is available (FSDP's fp16 hook calls ``record_stream`` on its
      CPU gradient, PowerSGD synchronises a CUDA stream): with the GPU visible, those cases failed the
      hooks for the machine, not for their arithmetic.
    """
    env = rank_env()
    if config.backend == "gloo" and sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if config.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _kill_ranks(procs: Sequence[Any], conns: Sequence[Connection], logs: Sequence[RankLog]) -> None:
    """SIGKILL each rank still running (its whole process group), wait for it, close its connection and log."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    for log in logs:
        log.close()


class RankPool:
    """``world_size`` persistent rank processes and the means to run cases on them.

    Raises:
        PoolStartError: from :meth:`start` (and so from :meth:`run`) when a rank
            fails to start; the message carries that rank's log.
    """

    def __init__(self, config: PoolConfig):
        self.config = config
        self.starts = 0
        self._procs: List[Any] = []  # subprocess.Popen, or _ForkedRank from the zygote
        self._conns: List[Connection] = []
        self._logs: List[RankLog] = []
        self._boards: List[PhaseBoard] = []  # each rank's phase (conformance.shared.phase_board)
        self._dir: Optional[str] = None
        self._seq = 0
        self._launched_at = 0.0
        self._ready = False
        self._rss_ready: List[Optional[int]] = []  # each rank's resident bytes when it was ready
        self._cases_run = 0
        # Ranks asked to stop when the pool went to another hook, not yet waited for: (procs, conns, logs, dir).
        self._retired: List[Tuple[List[Any], List[Connection], List[RankLog], Optional[str]]] = []

    # -- lifecycle -----------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Spawn the ranks without waiting for them (several pools can start at once).

        An interruption (Ctrl-C) while spawning kills the ranks already started.
        """
        self.close()
        with self._killed_on_error():
            self._spawn()

    @contextlib.contextmanager
    def _killed_on_error(self) -> Iterator[None]:
        """Any exception, Ctrl-C included, kills the ranks before it propagates: none is left running."""
        try:
            yield
        except BaseException:
            self.kill()
            raise

    def _spawn(self) -> None:
        self._logs = []
        self._boards = []
        cfg = self.config
        self.starts += 1
        self._dir = tempfile.mkdtemp(prefix="commhook-pool-")
        store_path = os.path.join(self._dir, "store")
        env = pool_env(cfg)
        zygote = _session_zygote()
        for rank in range(cfg.world_size):
            parent, child = socket.socketpair()
            out_r, out_w = os.pipe()
            self._logs.append(RankLog(out_r, cfg.log_limit_bytes))
            self._boards.append(PhaseBoard.create(os.path.join(self._dir, f"phase-{rank}")))
            proc: Any = None
            env = dict(env, CONFORM_RANK=str(rank))  # tells code that it runs in a rank (and which)
            try:
                if zygote is not None:
                    try:
                        proc = zygote.spawn(child, out_w, env)
                    except (EOFError, OSError):  # the zygote died: start this rank and the rest afresh
                        zygote = None
                if proc is None:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "conformance.worker", str(child.fileno()), str(os.getpid())],
                        pass_fds=(child.fileno(),),
                        stdin=subprocess.DEVNULL,
                        stdout=out_w,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
            finally:  # the rank holds its own copies; the log sees end of file when the rank is gone
                os.close(out_w)
                child.close()
            conn = Connection(parent.detach())
            send(conn, (Msg.HELLO, {
                "rank": rank,
                "world_size": cfg.world_size,
                "backend": cfg.backend,
                "device": cfg.device,
                "store_path": store_path,
                "phase_board": self._boards[-1].path,
                "pg_timeout_s": cfg.case_timeout_s + 60.0,
                "sys_path": list(cfg.sys_path or sys.path),
                "specs": list(cfg.specs),
            }))
            self._procs.append(proc)
            self._conns.append(conn)
        self._launched_at = time.monotonic()

    def wait_ready(self) -> None:
        """Wait until every launched rank has joined the process group.

        Raises:
            SpecLoadError: a rank could not load a hook spec.
            PoolStartError: a rank failed or did not join in time.
        An interruption (Ctrl-C) while waiting kills the ranks.
        """
        with self._killed_on_error():
            self._wait_ready()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        cfg = self.config
        self._rss_ready = [None] * cfg.world_size
        deadline = self._launched_at + cfg.start_timeout_s
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(remaining, 0))
            if not ready:
                self._fail_start(f"ranks {sorted(pending)} did not join the process group "
                                 f"within {cfg.start_timeout_s:.0f} s", sorted(pending))
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    kind, payload = recv(conn)
                except EOFError:
                    self._fail_start(f"rank {rank} exited during start-up "
                                     f"(exit code {self._procs[rank].wait()})", [rank])
                if kind == Msg.SPEC_FAILED:  # _killed_on_error stops the pool
                    raise SpecLoadError(f"rank {rank} of the {cfg.backend}/{cfg.device} pool of world size "
                                        f"{cfg.world_size} {payload}")
                if kind == Msg.FAILED:
                    self._fail_start(f"rank {rank} could not join the process group:\n{payload}", [rank])
                pending.pop(rank)
                # Memory is counted from here: every case this pool runs is one hook's (conformance.controller.runner).
                self._rss_ready[rank] = payload.get("rss") if isinstance(payload, dict) else None
        self._ready = True
        self._cases_run = 0

    def _fail_start(self, message: str, ranks: List[int]) -> None:
        logs = "\n".join(f"--- rank {r} log ---\n{self._logs[r].excerpt(1000, 3000)}" for r in ranks)
        cfg = self.config
        self.close()
        raise PoolStartError(
            f"could not start a {cfg.backend}/{cfg.device} pool of world size {cfg.world_size}: "
            f"{message}\n{logs}"
        )

    def serve(self, specs: Sequence[Tuple[str, str]]) -> None:
        """Give the pool to another hook (``specs``): its ranks, which ran the last hook's code, are told to stop
        and set aside (no case reaches them again); the next :meth:`launch` or :meth:`run` forks fresh ones that
        load only ``specs``, while the old ones exit. :meth:`reap` waits for those."""
        if tuple(specs) != tuple(self.config.specs):
            self._retire()
            self.config = dataclasses.replace(self.config, specs=tuple(specs))

    def _retire(self) -> None:
        """Send every rank SHUTDOWN and set it aside for :meth:`reap`: the pool is empty at once."""
        for conn in self._conns:
            try:
                send(conn, (Msg.SHUTDOWN, None))
            except OSError:
                pass
        if self._procs or self._conns or self._dir:
            self._retired.append((self._procs, self._conns, self._logs, self._dir))
        for board in self._boards:
            board.close()
        self._procs, self._conns, self._logs, self._boards, self._dir = [], [], [], [], None
        self._ready = False

    def reap(self) -> None:
        """Wait for the ranks :meth:`serve` told to stop (5 s in all, then SIGKILL), and free their pipes and
        store. The runner calls it after launching the next hook's pools, so old ranks exit while new ones
        start. Idempotent."""
        retired, self._retired = self._retired, []
        deadline = time.monotonic() + 5.0
        for procs, conns, logs, directory in retired:
            for proc in procs:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
            _kill_ranks(procs, conns, logs)
            if directory:
                shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        """Stop the ranks: politely when idle, by SIGKILL otherwise (those :meth:`serve` set aside too).
        Idempotent."""
        self._retire()
        self.reap()

    def kill(self) -> None:
        """SIGKILL every rank's process group at once (no polite shutdown), those :meth:`serve` set aside too.
        Idempotent."""
        _kill_ranks(self._procs, self._conns, self._logs)
        for procs, conns, logs, _ in self._retired:
            _kill_ranks(procs, conns, logs)
        self._procs, self._conns = [], []
        self._ready = False

    # -- running cases -------------------------------------------------------------
    def run(self, case: Case, timeout_s: Optional[float] = None) -> CaseResult:
        """Send ``case`` to every rank and gather one outcome per rank.

        The pool is (re)started first if needed. After every case the ranks
        all-reduce on the default process group and on every other process
        group they hold (:meth:`_in_step`): after a case in which a rank
        raised, hung or died, a pool whose ranks no longer match up is
        rebuilt; after one that every rank finished, a group that no
        longer works is the hook's doing (``CaseResult.group_broken``). A rank
        that reports its process state changed (``RankOutcome.leaks``), or whose
        resident memory grew past the bound since the pool started, also gets
        the pool rebuilt before the next case. The returned result says which.
        """
        if not self.alive:
            self.start()
        elif not self._ready:
            self.wait_ready()
        timeout_s = self.config.case_timeout_s if timeout_s is None else timeout_s
        n = self.config.world_size
        for log in self._logs:
            log.mark()
        started = time.perf_counter()
        self._cases_run += 1
        for board in self._boards:  # the ranks are idle: no phase of this case yet
            board.write("")
        send_all(self._conns, (Msg.CASE, case))
        outcomes: Dict[int, RankOutcome] = {}
        gather_outcomes(self._conns, outcomes, timeout_s, lambda rank, _: RankOutcome(
            rank=rank, exit_code=self._procs[rank].wait(), phase=self._boards[rank].read()),
            progress=lambda: [board.read() for board in self._boards])
        wall = time.perf_counter() - started
        timed_out = len(outcomes) < n and not any(not o.ok for o in outcomes.values())
        unfinished = [r for r in range(n) if r not in outcomes]
        rebuilt = False
        group_broken = ""
        for r, outcome in outcomes.items():
            if not outcome.ok:
                outcome.output = self._logs[r].excerpt(1000, 2000)
        grown: Tuple[Tuple[int, int, int], ...] = ()
        if unfinished:
            stacks = self._dump_stacks(unfinished)
            for r in unfinished:
                outcomes[r] = RankOutcome(rank=r, phase=self._boards[r].read(),
                                          stack=stacks.get(r, "(no stack written)"))
            self.kill()
            rebuilt = True
        else:
            problem = self._in_step()
            if problem is not None:
                rebuilt = True
                if all(o.ok for o in outcomes.values()):
                    group_broken = problem
        if not rebuilt and self.config.memory_growth_bytes:
            grown = memory_grown(self._rss_ready, outcomes.values(), self.config.memory_growth_bytes)
        if not rebuilt and (grown or any(o.leaks for o in outcomes.values())):
            self.kill()  # the next case gets ranks that never ran this hook's code
        ordered = tuple(outcomes[r] for r in range(n))
        return CaseResult(case=case, world_size=n, outcomes=ordered, timed_out=timed_out,
                          wall_s=wall, pool_rebuilt=rebuilt, memory_grown=grown,
                          memory_bound=self.config.memory_growth_bytes, cases_on_pool=self._cases_run,
                          group_broken=group_broken)

    def _in_step(self) -> Optional[str]:
        """After a case: :func:`in_step` on every process group the ranks hold; a pool that is not in step is
        killed (rebuilt on the next case)."""
        if not self.alive:
            self.kill()
            return "a rank is gone"
        self._seq += 1
        problem = in_step(self._conns, self._seq)
        if problem is not None:
            self.kill()
        return problem

    def _dump_stacks(self, ranks: List[int]) -> Dict[int, str]:
        for r in ranks:
            proc = self._procs[r]
            if proc.poll() is None and hasattr(signal, "SIGUSR1"):
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        return {r: self._logs[r].excerpt(0, 6000) or "(no stack written)" for r in ranks}
