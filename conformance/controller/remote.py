"""The controller side of a run whose ranks torchrun started, on one node or many (``conform --listen HOST:PORT``).

With ``--listen`` the controller starts no rank itself. torchrun
(``torch.distributed.elastic``) starts them on every node as
``torchrun ... -m conformance.worker --controller HOST:PORT``; each connects
here, proves it knows the shared secret (:mod:`conformance.shared.remote_link`) and
joins one process group from torchrun's environment
(:mod:`conformance.ranks.remote_worker`). :class:`RemotePool` then runs cases on
them exactly as :class:`conformance.controller.local_pool.RankPool` does on local ranks: same
messages, same outcomes, same verdicts.

* :class:`conformance.controller.remote_listener.RankListener` accepts connections, only
  on the address the user named, with a cap on concurrent handshakes and one
  deadline for each. Refused peers are counted and summarised (logger
  ``conformance.controller.remote``, and :func:`summary_lines` for the terminal summary);
  nothing a peer sends is unpickled before it authenticated, and the run goes on.
* One hook's code per process: when the run moves on to another hook, each
  rank replaces itself with a fresh interpreter (``os.execv``, same pid, no
  torchrun restart spent) and connects again (:meth:`RemotePool.serve`).
* Containment through the elastic agent: when a case hangs or a rank's
  connection drops, the pool asks the live ranks for their stacks, then closes
  every connection. Each rank's watchdog ends its process, torchrun's agents
  restart the worker group (``--max-restarts``), and the next case waits for
  the new ranks to connect (``--listen-timeout``). When none come back in
  time (restarts exhausted, or torchrun gone), the pool raises
  :class:`RanksNotConnected` for that case and every later one, without
  waiting again: a failure of the run, never of the hook under test.
"""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from conformance.controller.pools import PoolConfig, PoolStartError, SpecLoadError, gather_outcomes, in_step, memory_grown
from conformance.protocol import Case, CaseResult, Msg, RankOutcome, recv, send
from conformance.shared.remote_link import Address, format_address, read_authkey
from conformance.controller.remote_listener import RankListener, shutdown_rank

__all__ = ["RanksNotConnected", "RemotePool", "close_listener", "remote_pool", "summary_lines"]

#: Seconds a rank gets to send its stack (faulthandler) or its recent output when asked.
ASK_TIMEOUT_S = 5.0
#: What a case says of a rank whose connection dropped: its exit code stays on its node.
LOST = "lost its connection to the controller (the process died or was killed; its exit code is in the output " \
       "of the torchrun agent on {host})"


class RanksNotConnected(PoolStartError):
    """torchrun's ranks did not connect (or reconnect after a restart), so no case can run on them.

    A failure of the run, not of a hook: the runner ends the run as a run
    error (:data:`conformance.exit_codes.RUN_ERROR`), and the hooks it could
    not check read ``NOT RUN (reason)``.

    Attributes:
        reason: what happened and what to do, as ``str(exc)``.
        missing: the ranks that did not connect (``[]`` when torchrun's restarts
            are known to be used up, before any wait).
    """

    def __init__(self, reason: str, missing: Sequence[int] = ()):
        super().__init__(reason)
        self.reason = reason
        self.missing = list(missing)


class RemotePool:
    """The ranks torchrun started, a :class:`~conformance.controller.pools.Pool` as
    :class:`conformance.controller.local_pool.RankPool` is.

    Args:
        config: as for a local pool; ``world_size`` must equal torchrun's
            ``WORLD_SIZE``, ``start_timeout_s`` bounds the wait for the ranks
            to connect (at the start and after each restart) and join.
        listener: where the ranks connect.

    Raises:
        RanksNotConnected: from :meth:`start` (and :meth:`run`) when the ranks
            do not connect in time, or torchrun's restarts are used up; from
            then on at once, without waiting again.
        PoolStartError: the ranks connected but could not join their process group.
        SpecLoadError: a rank cannot load a hook spec (a usage error).
    """

    def __init__(self, config: PoolConfig, listener: RankListener):
        self.config = config
        self.listener = listener
        self.starts = 0
        self._conns: List[Connection] = []
        self._info: List[Dict[str, Any]] = []
        self._gone: Optional[RanksNotConnected] = None
        self._seq = 0
        #: The ranks were asked to exec afresh for another hook (:meth:`serve`): they come back without
        #: torchrun restarting them, so its restart count says nothing about whether they will.
        self._rehosting = False
        self._rss_ready: List[Optional[int]] = []
        self._cases_run = 0

    @property
    def nodes(self) -> Optional[int]:
        """The nodes torchrun spread the ranks over (their distinct ``GROUP_RANK``), once they joined, else
        ``None``: the real layout a case ran under, which its reach reports."""
        return len({info.get("group_rank", 0) for info in self._info}) or None

    # -- lifecycle -----------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._conns) and not any(c.closed for c in self._conns)

    def start(self) -> None:
        """Wait until torchrun's ranks have connected and joined their process group."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Nothing to spawn: torchrun starts the ranks (a restart is torchrun's, after :meth:`kill`)."""
        self.kill()

    def wait_ready(self) -> None:
        """Wait for ``world_size`` ranks to connect, send each the run's hello, wait until all are ready.

        Raises:
            RanksNotConnected: not every rank connected within ``start_timeout_s``,
                or torchrun's restarts are known to be used up.
            PoolStartError: a rank lost its connection or failed while joining the process group.
            SpecLoadError: a rank cannot load a hook spec.
        """
        if self._gone is None and not self._rehosting:
            self._gone = self._restarts_used_up()
        if self._gone is not None:  # a new instance each time: one exception raised twice keeps both tracebacks
            raise RanksNotConnected(self._gone.reason, self._gone.missing)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self._rehosting = False

    def _wait_ready(self) -> None:
        cfg = self.config
        n = cfg.world_size
        deadline = time.monotonic() + cfg.start_timeout_s
        joined: Dict[int, tuple] = {}
        while len(joined) < n:
            got = self.listener.next_join(deadline - time.monotonic())
            if got is None:
                self._gone = self._not_back(sorted(set(range(n)) - set(joined)))
                for conn, _ in joined.values():
                    conn.close()
                raise RanksNotConnected(self._gone.reason, self._gone.missing)
            conn, info = got
            if info["world_size"] != n:
                reason = (f"torchrun started WORLD_SIZE={info['world_size']} ranks (rank {info['rank']} on "
                          f"{info['host']} says so), but this run plans cases at --world-size {n}: run the "
                          f"controller with --world-size {info['world_size']}, or torchrun with --nnodes and "
                          f"--nproc-per-node that multiply to {n}")
                _refuse_join(conn, reason)
                for other, _ in joined.values():
                    _refuse_join(other, reason)
                pytest.exit(f"usage error: {reason}", returncode=pytest.ExitCode.USAGE_ERROR)
            old = joined.pop(info["rank"], None)
            if old is not None:  # a rank of an earlier worker group that had not gone yet
                old[0].close()
            joined[info["rank"]] = (conn, info)
        self.starts += 1
        self._conns = [joined[r][0] for r in range(n)]
        self._info = [joined[r][1] for r in range(n)]
        hello = {"backend": cfg.backend, "device": cfg.device, "pg_timeout_s": cfg.case_timeout_s + 60.0,
                 "specs": list(cfg.specs), "generation": f"{self.listener.token}/{self.starts}",
                 "log_limit_bytes": cfg.log_limit_bytes}
        for rank, conn in enumerate(self._conns):
            try:
                send(conn, (Msg.HELLO, hello))
            except OSError:
                raise PoolStartError(f"rank {rank} ({self._where(rank)}) lost its connection before it joined the "
                                     "process group; see the torchrun agent's output there") from None
        pending = dict(enumerate(self._conns))
        self._rss_ready = [None] * n
        self._cases_run = 0
        while pending:
            ready = wait(list(pending.values()), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise PoolStartError(f"ranks {sorted(pending)} of torchrun's worker group did not join the process "
                                     f"group within {cfg.start_timeout_s:.0f} s; see the torchrun agents' output")
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    kind, payload = recv(conn)
                except (EOFError, OSError):
                    raise PoolStartError(f"rank {rank} ({self._where(rank)}) exited while joining the process "
                                         "group; see the torchrun agent's output there") from None
                if kind == Msg.SPEC_FAILED:
                    raise SpecLoadError(f"rank {rank} ({self._where(rank)}) of torchrun's worker group of world size "
                                        f"{n} {payload}")
                if kind == Msg.FAILED:
                    raise PoolStartError(f"rank {rank} ({self._where(rank)}) could not join the process group:\n"
                                         f"{payload}")
                pending.pop(rank)
                self._rss_ready[rank] = payload.get("rss") if isinstance(payload, dict) else None

    def _restarts_used_up(self) -> Optional[RanksNotConnected]:
        """Why torchrun will not restart the stopped group, known from what its ranks reported; else ``None``.

        An agent whose workers failed with no restart left
        (``TORCHELASTIC_RESTART_COUNT`` equal to ``TORCHELASTIC_MAX_RESTARTS``)
        ends, and the group cannot meet again without it: no need to wait.
        """
        spent = [info for info in self._info if info["restart_count"] >= info["max_restarts"]]
        if self.starts == 0 or not spent:
            return None
        info = spent[0]
        return RanksNotConnected(
            f"torchrun's --max-restarts {info['max_restarts']} are used up (rank {info['rank']} on {info['host']} ran "
            f"as TORCHELASTIC_RESTART_COUNT={info['restart_count']}), so torchrun does not restart the ranks after the "
            "pool was stopped; this case and the rest did not run. Give torchrun more --max-restarts")

    def _not_back(self, missing: List[int]) -> RanksNotConnected:
        where = format_address(self.listener.address)
        wait_s = f"{self.config.start_timeout_s:g} s"
        if self.starts == 0:
            reason = (f"torchrun's ranks {missing} did not connect to {where} within {wait_s} (--listen-timeout): "
                      f"start 'torchrun --nnodes N --nproc-per-node G ... -m conformance.worker --controller {where}' "
                      "on every node, with the same shared secret; no case ran on them")
        else:
            reason = (f"torchrun's ranks {missing} did not reconnect to {where} within {wait_s} (--listen-timeout) "
                      f"after the pool was stopped ({self.starts} start(s) so far): torchrun's --max-restarts are "
                      "exhausted, or its agents ended (see their output); this case and the rest did not run")
        refused = self.listener.refused.summary()
        if refused is not None:  # ranks with another secret, say: they connected, and were refused
            reason += f". Meanwhile the listener {refused}"
        return RanksNotConnected(reason, missing)

    def _where(self, rank: int) -> str:
        info = self._info[rank] if rank < len(self._info) else {}
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')}"

    def serve(self, specs: Sequence[Tuple[str, str]], afresh: bool = False) -> None:
        """Give the ranks to another hook (``specs``), or with ``afresh`` to the same hook again (after it left
        a rank changed): each rank replaces itself with a fresh interpreter (``os.execv``,
        :func:`conformance.ranks.remote_worker.main`) and connects again, to load only ``specs``. No torchrun
        restart is spent; the next :meth:`run` waits for them (``--listen-timeout``)."""
        if tuple(specs) == tuple(self.config.specs) and not afresh:
            return
        for conn in self._conns:
            try:
                send(conn, (Msg.REHOST, None))
            except OSError:
                pass
        if self._conns:
            self._rehosting = True
        self.kill()
        self.config = dataclasses.replace(self.config, specs=tuple(specs))

    def reap(self) -> None:
        """Nothing to wait for: :meth:`serve` hands torchrun's ranks over at once (they re-exec themselves)."""

    def close(self) -> None:
        """Tell every rank to shut down (they exit 0, so torchrun ends), then stop listening. Idempotent."""
        for conn in self._conns:
            shutdown_rank(conn)
        self._conns = []
        self.listener.close()

    def kill(self) -> None:
        """Close every rank's connection: their watchdogs exit, and torchrun restarts the group. Idempotent."""
        for conn in self._conns:
            conn.close()
        self._conns = []

    # -- running cases -------------------------------------------------------------
    def run(self, case: Case, timeout_s: Optional[float] = None) -> CaseResult:
        """Send ``case`` to every rank and gather one outcome per rank (see :meth:`RankPool.run`).

        Waits for torchrun's ranks first when the pool is down. A case that
        hangs or loses a rank, or leaves the ranks out of step, stops the pool
        (torchrun restarts it); one that leaves a rank's process state changed,
        its default group broken or its memory grown past the bound makes the
        ranks exec afresh (:meth:`serve`). The result says the pool was rebuilt.
        """
        if not self.alive:
            self.start()
        timeout_s = self.config.case_timeout_s if timeout_s is None else timeout_s
        n = self.config.world_size
        started = time.perf_counter()
        outcomes: Dict[int, RankOutcome] = {}
        lost: set = set()
        for r, conn in enumerate(self._conns):
            try:
                send(conn, (Msg.CASE, case))
            except OSError:
                lost.add(r)
                outcomes[r] = RankOutcome(rank=r, lost=LOST.format(host=self._info[r]["host"]))

        def on_lost(rank: int, phase: str) -> RankOutcome:
            lost.add(rank)
            return RankOutcome(rank=rank, phase=phase, lost=LOST.format(host=self._info[rank]["host"]))

        phases = gather_outcomes(self._conns, outcomes, timeout_s, on_lost)
        wall = time.perf_counter() - started
        timed_out = len(outcomes) < n and not any(not o.ok for o in outcomes.values())
        unfinished = [r for r in range(n) if r not in outcomes]
        for r, outcome in outcomes.items():
            if not outcome.ok and r not in lost:
                outcome.output = self._ask(r, Msg.OUTPUT)
        rebuilt = False
        group_broken = ""
        grown: Tuple[Tuple[int, int, int], ...] = ()
        self._cases_run += 1
        if unfinished:
            for r in unfinished:
                stack = self._ask(r, Msg.STACKS) or "(no stack written)"
                outcomes[r] = RankOutcome(rank=r, phase=phases[r], stack=stack)
            self.kill()
            rebuilt = True
        elif lost:
            self.kill()
            rebuilt = True
        else:
            self._seq += 1
            problem = in_step(self._conns, self._seq)
            if problem is not None and not all(o.ok for o in outcomes.values()):
                self.kill()  # out of step after a failure: torchrun restarts the group
                rebuilt = True
            elif problem is not None:
                group_broken = problem
        if not rebuilt and self.config.memory_growth_bytes:
            grown = memory_grown(self._rss_ready, outcomes.values(), self.config.memory_growth_bytes)
        if not rebuilt and (group_broken or grown or any(o.leaks for o in outcomes.values())):
            self.serve(self.config.specs, afresh=True)  # the same hook, in processes that never ran its code
            rebuilt = True
        ordered = tuple(outcomes[r] for r in range(n))
        return CaseResult(case=case, world_size=n, outcomes=ordered, timed_out=timed_out, wall_s=wall,
                          pool_rebuilt=rebuilt, memory_grown=grown, memory_bound=self.config.memory_growth_bytes,
                          cases_on_pool=self._cases_run, group_broken=group_broken)

    def _ask(self, rank: int, what: Msg) -> str:
        """Rank ``rank``'s reply to ``(Msg.STACKS | Msg.OUTPUT, None)``, answered by its watchdog thread; ``""`` if none."""
        conn = self._conns[rank]
        reply = {Msg.STACKS: Msg.STACK, Msg.OUTPUT: Msg.OUTPUT}[what]
        try:
            send(conn, (what, None))
            deadline = time.monotonic() + ASK_TIMEOUT_S
            while conn.poll(max(deadline - time.monotonic(), 0)):
                kind, payload = recv(conn)
                if kind == reply:
                    return payload
        except (EOFError, OSError):
            pass
        return ""

def _refuse_join(conn: Connection, reason: str) -> None:
    try:
        send(conn, (Msg.REFUSED, reason))
    except OSError:
        pass
    conn.close()


_LISTENER: Optional[RankListener] = None


def remote_pool(config: PoolConfig, address: Address, listen_timeout_s: float) -> RemotePool:
    """The pool of torchrun's ranks for ``config``, on the session's listener at ``address`` (made on first use).

    Ends the session with a usage error (exit 4) when the shared secret is
    missing or exposed, or ``address`` cannot be listened on.
    """
    global _LISTENER
    if _LISTENER is None or _LISTENER.closed:
        where = format_address(address)
        try:
            _LISTENER = RankListener(address, read_authkey())
        except OSError as exc:
            pytest.exit(f"usage error: cannot listen on {where} (--listen): {exc.strerror or exc}. Use an address of "
                        "this node that the other nodes can reach, and a free port", returncode=4)
        except ValueError as exc:  # LinkError: no secret, or a file others can read
            pytest.exit(f"usage error: {exc}", returncode=4)
    return RemotePool(dataclasses.replace(config, start_timeout_s=listen_timeout_s), _LISTENER)


def close_listener() -> None:
    """Stop the session's listener, if any. Idempotent."""
    if _LISTENER is not None:
        _LISTENER.close()


def summary_lines() -> List[str]:
    """Lines for the terminal summary: the connections the session's listener refused, summarised in one line
    (:meth:`conformance.controller.remote_listener.RefusedPeers.summary`: the count, the first peers' addresses, the count per
    reason); ``[]`` when it refused none or there is no listener."""
    summary = None if _LISTENER is None else _LISTENER.refused.summary()
    if summary is None:
        return []
    return [f"--listen {format_address(_LISTENER.address)}: {summary}"]
