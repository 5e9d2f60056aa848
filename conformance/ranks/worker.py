"""The rank side of the pool: one process per rank, alive for the whole session.

Started by :class:`conformance.controller.local_pool.RankPool` as ``python -m conformance.worker
FD`` where ``FD`` is this process's end of a socket pair to the controller
(torchrun starts it as ``... -m conformance.worker --controller HOST:PORT``
instead: see :mod:`conformance.ranks.remote_worker`).
The worker joins the pool's process group once, then loops: receive a
:class:`~conformance.protocol.Case`, run the registered rank check, send back a
:class:`~conformance.protocol.RankOutcome`. ``SIGUSR1`` makes it dump every
thread's stack to its log (the controller asks for that when a case hangs).
An optional second argument is the parent's pid (the controller, or the
zygote that forked this rank): the rank then ends by itself when its parent or
the controller's socket is gone (:mod:`conformance.ranks.lifeline`).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
# Bound here, when this module is imported: before any hook's module is (see _suite_all_reduce).
from torch.distributed.distributed_c10d import all_reduce as _all_reduce_before_hooks

from conformance.shared.phase_board import PhaseBoard
from conformance.shared.spec_loading import load_target
from conformance.shared.standalone_launch import pin_nccl
from conformance.protocol import Msg, RankOutcome, as_check_result, recv, send
from conformance.ranks import cost, hook_code, lifeline, process_state, reach, topology
from conformance.ranks.checks import get_rank_check, register_every_check
from conformance.ranks.diagnosis import diagnosing

if TYPE_CHECKING:  # pragma: no cover
    from conformance.protocol import Case, HookRef
    from conformance.spec import HookSpec


def _suite_all_reduce() -> Any:
    """``torch.distributed.all_reduce`` as it was before any hook code ran in this process (bound when this
    module is imported, before :meth:`_Worker.load_specs` imports a hook's module): the suite's own
    collectives must work even where a hook monkeypatched ``torch.distributed`` (which
    :mod:`conformance.ranks.process_state` then reports)."""
    return _all_reduce_before_hooks


def groups_held() -> List[Any]:
    """The process groups other than the default one that this rank belongs to, in the order this process
    created them: PyTorch's registry of groups (``torch.distributed.distributed_c10d._world.pg_map``, private;
    empty where a torch version lacks it). Creating a group is collective over the default group, in the
    same order on every rank, so walking the groups in this order on every rank cannot deadlock."""
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not isinstance(pg_map, dict) or not dist.is_initialized():
        return []
    default = dist.distributed_c10d._get_default_group()
    non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return [g for g in pg_map if g is not default and g is not non_member and g is not None]



def join_process_group(kwargs: Dict[str, Any]) -> None:
    """``dist.init_process_group(**kwargs)``; on NCCL, NCCL's choices pinned first in this rank's environment
    (:func:`~conformance.shared.standalone_launch.pin_nccl`: the user's own settings win), before the first
    communicator reads them, so that a reduction's bits are a function of its inputs."""
    if kwargs.get("backend") == "nccl":
        pin_nccl(os.environ)
    cost.ring_defaults(os.environ)
    dist.init_process_group(**kwargs)

class RankContext:
    """What a rank check gets besides its parameters.

    Attributes:
        rank: this process's rank in ``group``.
        world_size: the number of ranks in ``group``.
        group: the process group the pool joined (the default group).
        device: ``torch.device("cpu")`` or this rank's ``cuda:N``.
        backend: ``"gloo"`` or ``"nccl"``.

    Without ``conn`` (a rank started by another launcher, e.g. the
    spawn-per-case benchmark) phases are kept but not reported. With ``board`` (a local pool's rank) they
    are written there, where the controller reads them, instead of sent on ``conn``.
    """

    def __init__(self, rank: int, world_size: int, group: Optional[dist.ProcessGroup], device: torch.device,
                 backend: str, conn: Optional[Connection] = None, board: Optional[PhaseBoard] = None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = device
        self.backend = backend
        self._conn = conn
        self._board = board
        self.current_phase = ""
        self._on_error: Optional[Callable[[], List[Any]]] = None

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (an all-reduce with MAX over the group).

        Checks stop early only when every rank agrees to: a rank that returned
        while its peers went on would leave them blocked in the next collective.
        """
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        _suite_all_reduce()(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def phase(self, text: str) -> None:
        """Announce what this rank is doing now; shown if the case hangs."""
        self.current_phase = text
        self._post(text)

    def notice(self, text: str) -> None:
        """Announce, beside the current phase, what the hook already did wrong in it (a recorder's contract
        finding): where the rank then dies or hangs in this phase (a collective the hook left running can abort
        gloo), its report names it (``during 'step 0: ...; before it died or hung: ...'``). The next
        :meth:`phase` replaces it; :attr:`current_phase` is unchanged."""
        self._post(f"{self.current_phase}; before it died or hung: {text}")

    def _post(self, text: str) -> None:
        if self._board is not None:
            self._board.write(text)
        elif self._conn is not None:
            send(self._conn, (Msg.PHASE, text))

    def report_on_error(self, collect: Optional[Callable[[], List[Any]]]) -> None:
        """If the check raises from now on, report ``collect()`` (its findings so far) above the traceback.

        A recorder that saw the hook go wrong (a buffer of the wrong shape) often
        sees it before PyTorch raises on the consequence (a collective's size
        check); without this, only the traceback would reach the report.
        ``collect`` replaces the previous one; ``None`` clears it, and so does
        the start of every case. It runs after the exception, on this rank, and
        returns :class:`~conformance.protocol.Finding` objects.
        """
        self._on_error = collect

    def findings_before_error(self) -> List[Any]:
        """What the registered ``collect()`` returns now; empty without one, or if it raises itself (the
        check's own error is the one to report)."""
        if self._on_error is None:
            return []
        try:
            return list(self._on_error())
        except Exception:  # noqa: BLE001 - never hide the check's exception behind the collector's
            return []


class _Worker:
    def __init__(self, conn: Connection, hello: Dict[str, Any]):
        self.conn = conn
        self.rank: int = hello["rank"]
        self.world_size: int = hello["world_size"]
        self.backend: str = hello["backend"]
        self.device_type: str = hello["device"]
        self._specs: Dict[tuple, Any] = {}
        #: Where this rank's phases go (a local pool's rank: :mod:`conformance.shared.phase_board`), or ``None``.
        self.board = PhaseBoard(hello["phase_board"]) if hello.get("phase_board") else None
        self.clean: Optional[process_state.Fingerprint] = None
        self.import_leaks: List[str] = []
        #: The controller asked this rank to start afresh for another hook (torchrun's ranks only:
        #: :func:`conformance.ranks.remote_worker.main` then execs itself).
        self.rehost = False

    def prepare(self, device_index: Optional[int] = None) -> None:
        """Set up what the suite itself changes in the process (threads, device, the check registry),
        then take the clean :class:`~conformance.ranks.process_state.Fingerprint`: before any hook code runs
        here, so what the hook's module import or its cases change is told apart from the suite's own.

        ``device_index``: the CUDA device of this rank (default: its rank; torchrun's: its local rank).
        """
        if self.device_type == "cpu":
            torch.set_num_threads(1)
            self.device = torch.device("cpu")
        else:
            index = self.rank if device_index is None else device_index
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        # Fill the check registry before the first case (imports every API's rank side).
        register_every_check()
        _suite_all_reduce()
        self.clean = process_state.take()

    def start(self, hello: Dict[str, Any]) -> None:
        """Join the pool's process group (after :meth:`prepare` and :meth:`load_specs`) and say ready."""
        store = dist.FileStore(hello["store_path"], self.world_size)
        kwargs = dict(
            backend=self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=hello["pg_timeout_s"]),
        )
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        join_process_group(kwargs)
        self.joined()
        send(self.conn, (Msg.READY, self.ready_info()))

    def ready_info(self) -> Dict[str, Any]:
        """What the rank says when it is ready: who it is, its torch, and its resident memory in bytes (from
        which the controller counts the growth over the hook's cases)."""
        return {"rank": self.rank, "pid": os.getpid(), "torch": torch.__version__,
                "rss": process_state.resident_bytes()}

    def joined(self, conn: Optional[Connection] = None) -> None:
        """After the rank joined its process group: keep the group, make the check context (reporting on
        ``conn``, default: the controller connection), and note what the hook's module import already
        changed (reported with every case, since a rebuilt pool imports it again)."""
        self.group = dist.group.WORLD
        self.ctx = RankContext(self.rank, self.world_size, self.group, self.device, self.backend,
                               conn if conn is not None else self.conn, board=self.board)
        self.import_leaks = process_state.changes(self.clean, process_state.take(), self.group)

    def load_specs(self, wanted: Iterable[Sequence[str]]) -> Optional[str]:
        """Load every ``(target, name)`` spec the controller loaded; why one failed, or ``None``.

        Runs before the rank joins the process group, so a module that imports
        on the controller but not here is a usage error before the first case,
        never a hook failure.
        """
        for target, name in wanted:
            if (target, name) in self._specs:
                continue
            try:
                for spec in load_target(target):
                    self._specs[(target, spec.name)] = spec
            except BaseException as exc:  # noqa: BLE001 - reported to the controller as a usage error
                # load_target's SpecError hides the import's own traceback (raise ... from None);
                # the user needs it, so report the exception it was raised from.
                cause = exc.__context__ if exc.__context__ is not None else exc
                trace = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
                return (f"could not load hook target {target!r}, which loaded on the controller "
                        f"(sys.path {sys.path[:3]}...):\n{trace.rstrip()}\n{exc}")
            if (target, name) not in self._specs:
                here = sorted(n for t, n in self._specs if t == target)
                return (f"loaded hook target {target!r}, but it has no spec named {name!r} here; it defines "
                        f"{', '.join(here) or 'none'}. On the controller it defined {name!r}: the module must build "
                        "the same spec names in every process (no names from random numbers, time or the pid)")
        return None

    def load_spec(self, ref: HookRef) -> HookSpec:
        """The spec of ``ref`` (a :class:`~conformance.protocol.HookRef`), loaded on first use if the pool
        was not told to load it at start-up."""
        problem = self.load_specs([(ref.target, ref.name)])
        if problem is not None:
            raise RuntimeError(problem)
        return self._specs[(ref.target, ref.name)]

    def case_layout(self, case: Case) -> Dict[str, str]:
        """torchrun's layout variables a case sets while it runs: those of ``case.nodes`` nodes where it
        simulates several, else none (the rank keeps its own: one node, or torchrun's real layout)."""
        nodes = getattr(case, "nodes", 1)
        return topology.torchrun_env(self.rank, self.world_size, nodes) if nodes > 1 else {}

    def run_case(self, case: Case) -> Any:
        self.ctx.current_phase = "setting up"
        self.ctx.report_on_error(None)
        reach.start()
        cost.start()
        hook_code.start(None)
        start = time.perf_counter()
        try:
            fn = get_rank_check(case.check)
            spec = self.load_spec(case.hook) if case.hook is not None else None
            hook_code.start(spec, enabled=getattr(case, "hook_code", True))
            with topology.simulated(self.case_layout(case)), diagnosing(getattr(case, "diagnose", True)):
                value = as_check_result(fn(self.ctx, spec, **case.params))
            outcome = RankOutcome(
                rank=self.rank, ok=True, value=value,
                compute_s=time.perf_counter() - start, phase=self.ctx.current_phase,
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the controller, rank stays up
            outcome = RankOutcome(
                rank=self.rank, ok=False, error=traceback.format_exc(), error_type=type(exc).__name__,
                compute_s=time.perf_counter() - start, phase=self.ctx.current_phase,
                findings_before_error=self.ctx.findings_before_error(),
            )
        outcome.leaks = self.leaks()
        process_state.release_freed_memory()
        outcome.rss = process_state.resident_bytes()
        outcome.reach = reach.read()
        outcome.cost = cost.read() if outcome.ok else {}
        outcome.hook_code = hook_code.read()
        return outcome

    def leaks(self) -> List[str]:
        """What differs from the clean fingerprint now, each phrase saying when it was left: at the
        module's import (before any case of this pool) or during the case just run."""
        if self.clean is None:
            return []
        try:
            now = process_state.changes(self.clean, process_state.take(), self.group)
        except Exception as exc:  # noqa: BLE001 - a state too broken to read is a leak in itself
            return [f"process state that cannot be read any more ({type(exc).__name__}: {exc})"]
        return [f"{what}, since the hook's module was imported (before any case ran)" if what in self.import_leaks
                else what for what in now]

    def ping(self, seq: int) -> Optional[int]:
        """All-reduce ``seq`` on the default group, then on every other process group this rank holds
        (:func:`groups_held`): proves, after every case, that the groups still work and the ranks still match
        up in each. A collective that not every rank of a group joined (an async one issued on some ranks
        only, or cut short by a rank that raised) leaves the group's ranks a collective apart, and the next
        case's first collective there would pair with the stale one (gloo then aborts the rank in C++, or
        mixes the data).

        Raises:
            RuntimeError: a group's all-reduce did not sum to ``seq`` times its size.
        """
        t = torch.tensor([seq], dtype=torch.int64, device=self.device)
        # The default group as a hook would find it (group=None), not the handle kept at start: a hook
        # that destroyed or replaced it must fail here, not in the next hook's first collective.
        _suite_all_reduce()(t)
        for i, group in enumerate(groups_held()):
            g = torch.tensor([seq], dtype=torch.int64, device=self.device)
            _suite_all_reduce()(g, group=group)
            size = dist.get_world_size(group)
            if int(g.item()) != seq * size:
                raise RuntimeError(f"process group {i + 1} of this rank after the default one ({size} ranks) is "
                                   f"out of step: an all-reduce summed {int(g.item())}, expected {seq * size}")
        return int(t.item())

    def loop(self) -> None:
        while True:
            try:
                kind, payload = recv(self.conn)
            except EOFError:
                return
            if kind == Msg.CASE:
                outcome = self.run_case(payload)
                try:
                    send(self.conn, (Msg.OUTCOME, outcome))
                except Exception as exc:  # noqa: BLE001 - an unpicklable result must not kill the rank
                    send(self.conn, (Msg.OUTCOME, RankOutcome(
                        rank=self.rank, error=f"the check's result could not be sent to the controller: {exc!r}",
                        error_type=type(exc).__name__, phase=outcome.phase)))
            elif kind == Msg.PING:
                try:
                    send(self.conn, (Msg.PONG, self.ping(payload)))
                except Exception as exc:  # noqa: BLE001
                    send(self.conn, (Msg.PONG, f"{type(exc).__name__}: {exc}"))
            elif kind == Msg.REHOST:
                send(self.conn, (Msg.BYE, None))
                self.rehost = True
                return
            elif kind == Msg.SHUTDOWN:
                if dist.is_initialized():
                    dist.destroy_process_group()
                send(self.conn, (Msg.BYE, None))
                return


def main(argv: Optional[list] = None) -> int:
    """Serve the local pool's cases on the socket ``argv[0]`` (a file descriptor; ``argv[1]``, optional: the
    parent's pid) until the controller says :attr:`~conformance.protocol.Msg.SHUTDOWN`. torchrun's ranks
    start with :func:`conformance.ranks.remote_worker.main` instead (:mod:`conformance.worker` picks)."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    conn = Connection(sock.detach())
    if len(argv) > 1:  # ends this rank when the controller is gone, even mid-hook
        lifeline.die_with_parent(int(argv[1]))
        lifeline.exit_when_closed(conn.fileno(), int(argv[1]))
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    # FSDP deprecates NO_SHARD in favour of DDP; checking NO_SHARD hooks is the point here.
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
    kind, hello = recv(conn)
    assert kind == Msg.HELLO, kind
    sys.path[:] = hello["sys_path"]
    importlib.invalidate_caches()
    # torchrun's layout variables, as `torchrun --nproc-per-node N` sets them on one node, before the hook's
    # module is imported: a hook that reads them finds what it would under torchrun (the remote ranks,
    # which torchrun started, keep their real ones).
    os.environ.update(topology.torchrun_env(hello["rank"], hello["world_size"]))
    worker = _Worker(conn, hello)
    try:
        worker.prepare()
    except BaseException:  # noqa: BLE001
        send(conn, (Msg.FAILED, traceback.format_exc()))
        return 1
    problem = worker.load_specs(hello.get("specs", ()))
    if problem is not None:
        send(conn, (Msg.SPEC_FAILED, problem))
        return 1
    try:
        worker.start(hello)
    except BaseException:  # noqa: BLE001
        send(conn, (Msg.FAILED, traceback.format_exc()))
        return 1
    worker.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
