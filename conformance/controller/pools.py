"""What the two launchers of rank pools share: how a pool is configured, the :class:`Pool` protocol the
runner is typed against, its errors, and the steps of a case both run alike.

The launchers: :class:`conformance.controller.local_pool.RankPool` (ranks this machine starts, forked from the
zygote) and :class:`conformance.controller.remote.RemotePool` (ranks torchrun started, on any node). Both
send a case to every rank and gather one outcome each (:func:`gather_outcomes`), then check that the
ranks still all-reduce together (:func:`in_step`) and that no rank's memory grew past the bound
(:func:`memory_grown`).
"""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, Iterable, Optional, Protocol, Sequence, Tuple

from conformance.controller.options import DEFAULT_RANK_LOG_LIMIT_MIB, DEFAULT_RANK_MEMORY_GROWTH_MIB
from conformance.protocol import Case, CaseResult, Msg, RankOutcome, recv, send

__all__ = ["MAX_TIMEOUTS_PER_CASE", "Pool", "PoolConfig", "PoolStartError", "STRAGGLER_GRACE_S", "SpecLoadError",
           "gather_outcomes", "in_step", "memory_grown"]

#: Seconds the other ranks get to finish after one rank raised or died. A rank
#: blocked in a collective its peer never joined will not finish at all.
STRAGGLER_GRACE_S = 5.0
#: A case that keeps making progress (:func:`gather_outcomes`) runs for at most this many case timeouts.
MAX_TIMEOUTS_PER_CASE = 10


class PoolStartError(RuntimeError):
    """The pool's processes could not start or join their process group."""


class SpecLoadError(PoolStartError):
    """A hook spec that loaded on the controller could not be loaded inside a rank.

    A usage error, not a hook failure: the message carries the rank's traceback.
    """


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How to start a pool.

    Attributes:
        world_size: number of rank processes.
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"`` (rank ``r`` uses ``cuda:r``).
        case_timeout_s: seconds a case may go without progress (a rank's phase changing) before it is called
            hung (:func:`gather_outcomes`).
        start_timeout_s: seconds the ranks get to import torch and rendezvous.
        sys_path: the module search path of every rank, the controller's own
            at the time it loaded the specs (empty: the controller's current one),
            so that the controller and the ranks resolve every module alike.
        specs: ``(module:ATTR target, spec name)`` pairs each rank loads while
            it starts; one that fails is a :class:`SpecLoadError`.
        log_limit_bytes: bytes of each rank's output kept per case (:class:`RankLog`).
        memory_growth_bytes: bytes a rank's resident memory may grow over the cases
            the pool runs (one hook's) before the pool is restarted after the case
            that crossed it; 0 for no check.
    """

    world_size: int
    backend: str
    device: str
    case_timeout_s: float = 60.0
    start_timeout_s: float = 180.0
    sys_path: Tuple[str, ...] = ()
    specs: Tuple[Tuple[str, str], ...] = ()
    log_limit_bytes: int = int(DEFAULT_RANK_LOG_LIMIT_MIB * 2**20)
    memory_growth_bytes: int = int(DEFAULT_RANK_MEMORY_GROWTH_MIB * 2**20)



class Pool(Protocol):
    """A pool of ranks that runs cases: what :class:`conformance.controller.runner.Runner` uses of one.

    Implemented by :class:`conformance.controller.local_pool.RankPool` (local ranks) and
    :class:`conformance.controller.remote.RemotePool` (torchrun's ranks).

    Attributes:
        config: how the pool starts (its world size, backend, device, the specs its ranks load).
        starts: how many times its ranks were started (or connected).
    """

    config: PoolConfig
    starts: int

    @property
    def alive(self) -> bool:
        """Whether the ranks are up (started, or connected, and not known to be gone)."""
        ...

    def start(self) -> None:
        """:meth:`launch`, then :meth:`wait_ready`."""
        ...

    def launch(self) -> None:
        """Start the ranks without waiting for them, so that several pools start at once.

        Raises:
            PoolStartError: the ranks could not be started.
        """
        ...

    def wait_ready(self) -> None:
        """Wait until every rank joined the pool's process group.

        Raises:
            SpecLoadError: a rank could not load a hook spec (a usage error).
            PoolStartError: a rank failed, or did not join in time.
        """
        ...

    def serve(self, specs: Sequence[Tuple[str, str]]) -> None:
        """Give the pool to another hook: its ``(module:ATTR target, spec name)`` pairs; ranks that loaded
        other specs are stopped (they ran another hook's code), and the next start loads only ``specs``."""
        ...

    def reap(self) -> None:
        """Wait for the ranks :meth:`serve` stopped, if it left them exiting (a local pool does, so the next
        hook's ranks start meanwhile). Idempotent."""
        ...

    def run(self, case: Case, timeout_s: Optional[float] = None) -> CaseResult:
        """Run ``case`` on every rank (starting the pool if needed), at most ``timeout_s`` seconds (default:
        ``config.case_timeout_s``), and gather one :class:`~conformance.protocol.RankOutcome` per rank.

        Raises:
            SpecLoadError, PoolStartError: as for :meth:`wait_ready`, when the pool had to start.
        """
        ...

    def close(self) -> None:
        """Stop the ranks politely (:attr:`~conformance.protocol.Msg.SHUTDOWN`). Idempotent."""
        ...

    def kill(self) -> None:
        """Stop the ranks at once, with no polite shutdown. Idempotent."""
        ...


def gather_outcomes(conns: Sequence[Connection], outcomes: Dict[int, RankOutcome], timeout_s: float,
                    on_lost: Callable[[int, str], RankOutcome],
                    progress: Optional[Callable[[], Any]] = None) -> Dict[int, str]:
    """Collect one :class:`RankOutcome` per rank of ``conns`` into ``outcomes`` (ranks already in it are
    not waited for), relaying ``phase`` messages, until the ranks make no progress for ``timeout_s`` seconds;
    once a rank failed, the others get :data:`STRAGGLER_GRACE_S` more. Progress is a rank's announced phase
    changing (each training step announces one): a ``phase`` message, or ``progress()`` (the phases on the
    local pool's shared pages) returning something new. A case that keeps making progress is given at most
    :data:`MAX_TIMEOUTS_PER_CASE` times ``timeout_s`` in all: a 2,000-step long run on a loaded machine is
    slow, not hung, and a hook that hangs stops announcing. A rank whose connection breaks gets
    ``on_lost(rank, last phase)``. Returns each rank's last announced phase. Both launchers use it: the
    local :class:`conformance.controller.local_pool.RankPool` and :class:`conformance.controller.remote.RemotePool`.
    """
    phases = {r: "" for r in range(len(conns))}

    def seen() -> Any:
        return tuple(phases.values()), progress() if progress is not None else None

    start = time.monotonic()
    deadline, last_limit, last_seen = start + timeout_s, start + MAX_TIMEOUTS_PER_CASE * timeout_s, seen()
    grace_deadline: Optional[float] = None
    while len(outcomes) < len(conns):
        limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
        waiting = [c for r, c in enumerate(conns) if r not in outcomes]
        ready = wait(waiting, timeout=max(limit - time.monotonic(), 0))
        if not ready:
            now, now_seen = time.monotonic(), seen()
            if grace_deadline is None and now < last_limit and now_seen != last_seen:
                deadline, last_seen = min(now + timeout_s, last_limit), now_seen
                continue
            break
        for conn in ready:
            rank = conns.index(conn)
            try:
                kind, payload = recv(conn)
            except (EOFError, OSError):
                outcomes[rank] = on_lost(rank, phases[rank])
                continue
            if kind == Msg.PHASE:
                phases[rank] = payload
            elif kind == Msg.OUTCOME:
                outcomes[rank] = payload
        if grace_deadline is None and any(not o.ok for o in outcomes.values()):
            grace_deadline = time.monotonic() + STRAGGLER_GRACE_S
    return phases

def in_step(conns: Sequence[Connection], seq: int) -> Optional[str]:
    """After a case, every rank all-reduces ``seq`` on the default process group as a hook would find it
    (``group=None``), then on every other process group it holds (``conformance.ranks.worker.groups_held``):
    ``None`` when each answers ``seq * len(conns)``; else why not (a rank that is gone or silent for
    :data:`STRAGGLER_GRACE_S`, ranks out of step, or a rank's error: a default group that was destroyed or
    replaced, another group out of step). A group out of step is one that a collective left behind: issued
    on some ranks only, or by a rank that raised between two collectives; the next collective there would
    pair with the stale one. Both launchers use it (:class:`conformance.controller.local_pool.RankPool`,
    :class:`conformance.controller.remote.RemotePool`).
    """
    for conn in conns:
        try:
            send(conn, (Msg.PING, seq))
        except OSError:
            return f"rank {list(conns).index(conn)} is gone"
    expected = seq * len(conns)
    deadline = time.monotonic() + STRAGGLER_GRACE_S
    replies = 0
    while replies < len(conns):
        ready = wait(list(conns), timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            return f"the ranks did not all answer an all-reduce within {STRAGGLER_GRACE_S:g} s"
        for conn in ready:
            rank = list(conns).index(conn)
            try:
                kind, payload = recv(conn)
            except (EOFError, OSError):
                return (f"rank {rank} died in the all-reduce on its process groups (gloo aborts a rank whose "
                        "collective meets a stale one of another size)")
            if kind != Msg.PONG:
                continue
            if isinstance(payload, str):
                return f"rank {rank}: {payload}"
            if payload != expected:
                return f"the ranks are out of step (rank {rank} summed {payload}, expected {expected})"
            replies += 1
    return None


def memory_grown(rss_ready: Sequence[Optional[int]], outcomes: Iterable[RankOutcome], bound: int
                 ) -> Tuple[Tuple[int, int, int], ...]:
    """``(rank, bytes grown, bytes now)`` of each rank whose resident memory (``RankOutcome.rss``) grew by
    more than ``bound`` bytes since it was ready (``rss_ready[rank]``): over every case of its pool, which are
    the cases of one hook. Both launchers use it."""
    grown = []
    for o in outcomes:
        before = rss_ready[o.rank] if o.rank < len(rss_ready) else None
        if before is not None and o.rss is not None and o.rss - before > bound:
            grown.append((o.rank, o.rss - before, o.rss))
    return tuple(sorted(grown))
