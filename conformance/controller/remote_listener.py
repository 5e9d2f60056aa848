"""The ``--listen`` listener: where torchrun's ranks connect, and what it does with everyone else.

:class:`RankListener` accepts connections in one background thread, only on the
address the user named, and runs each peer's handshake
(:class:`conformance.shared.remote_link.Handshake`: the shared secret both ways, then
the rank's ``(Msg.JOIN, info)``) in a thread of its own. It holds under abuse:

* at most ``max_handshakes`` handshakes run at once; a peer that connects
  while they all are under way is closed at once (a real rank retries);
* each handshake has one deadline for all of it, ``handshake_timeout_s``
  seconds, however the peer paces its bytes;
* :meth:`RankListener.close` ends every handshake still under way, so no
  connection outlives the run;
* refused peers are counted (:class:`RefusedPeers`): the log gets the first
  refusal of each kind and, at the end, one summary line, never a line per peer.

Nothing a peer sends is unpickled before it has proved that it knows the secret.
"""

from __future__ import annotations

import collections
import logging
import pickle
import queue
import socket
import threading
import time
import uuid
from multiprocessing.connection import AuthenticationError, Connection
from typing import Any, Dict, List, Optional, Tuple, Union

from conformance.protocol import Msg, recv, send
from conformance.shared.remote_link import HANDSHAKE_TIMEOUT_S, Address, Handshake, HandshakeTimeout, format_address

__all__ = ["MAX_HANDSHAKES", "RankListener", "RefusedPeers", "shutdown_rank"]

log = logging.getLogger("conformance.controller.remote")

#: Handshakes that may run at once. A rank's takes a few milliseconds, and a rank closed for the
#: cap retries (``remote_link.connect``), so only a flood meets it; it bounds the threads and
#: sockets that a flood of silent connections can hold to this number.
MAX_HANDSHAKES = 64
#: Bytes of a rank's join message (a small dict of torchrun's variables); more is no rank.
MAX_JOIN_BYTES = 64 * 1024
#: Peer addresses a summary names; the rest are counted.
SHOWN_PEERS = 5
#: Seconds :meth:`RankListener.close` waits for the handshake threads it ended to return.
CLOSE_WAIT_S = 2.0
#: An accepted connection's peer, as ``socket.accept`` gives it: ``(host, port)``, or IPv6's
#: ``(host, port, flowinfo, scope_id)``.
Peer = Union[Tuple[str, int], Tuple[str, int, int, int]]


class RefusedPeers:
    """The connections a listener refused: how many, why (a count per reason), and the first few peers.

    Thread-safe. ``len()`` is the number refused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_reason: "collections.Counter[str]" = collections.Counter()
        self.first_peers: List[str] = []
        self._hosts: set = set()
        self._first_at: Optional[float] = None
        self._last_at: Optional[float] = None

    def add(self, peer: Peer, reason: str) -> bool:
        """Count one refused ``peer`` (``(host, port, ...)``); ``True`` when it is the first with ``reason``."""
        with self._lock:
            now = time.time()
            self._first_at = now if self._first_at is None else self._first_at
            self._last_at = now
            self._hosts.add(peer[0])
            if len(self.first_peers) < SHOWN_PEERS:
                self.first_peers.append(format_address(peer[:2]))
            self.by_reason[reason] += 1
            return self.by_reason[reason] == 1

    def __len__(self) -> int:
        with self._lock:
            return sum(self.by_reason.values())

    def summary(self) -> Optional[str]:
        """One line: the count, the hosts, the first peers, the time span and the count per reason; ``None`` if none.

        E.g. ``refused 820 connections from 1 host (127.0.0.1:40312, ...) between 10:01:02 and 10:01:19: 604 ...``
        """
        with self._lock:
            total = sum(self.by_reason.values())
            if not total:
                return None
            peers = ", ".join(self.first_peers) + (", ..." if total > len(self.first_peers) else "")
            span = time.strftime("%H:%M:%S", time.localtime(self._first_at))
            if total > 1:
                span = f"between {span} and {time.strftime('%H:%M:%S', time.localtime(self._last_at))}"
            else:
                span = f"at {span}"
            reasons = "; ".join(f"{n} {why}" for why, n in self.by_reason.most_common())
            hosts = len(self._hosts)
            return (f"refused {total} connection{'s' if total > 1 else ''} from {hosts} host{'s' if hosts > 1 else ''} "
                    f"({peers}) {span}: {reasons}. Nothing was unpickled from a peer before it proved it knows the "
                    "shared secret.")


class RankListener:
    """Accepts torchrun's ranks on ``address`` (this address only), authenticating each, in background threads.

    Each peer gets a :class:`conformance.shared.remote_link.Handshake` (the
    challenge/response of ``multiprocessing.connection``, both ways) before
    anything it sends is unpickled; then its ``(Msg.JOIN, info)`` is read, and the
    rank waits in :meth:`next_join`.

    Args:
        address: ``(host, port)`` to bind; port 0 picks a free one (see ``address`` after).
        authkey: the shared secret.
        handshake_timeout_s: seconds for a peer's whole handshake, join included.
        max_handshakes: handshakes under way at once; peers beyond are closed at
            once and counted in :attr:`refused`.

    Raises:
        OSError: from the constructor, when ``address`` cannot be bound (not an
            address of this node, or the port is in use).
    """

    def __init__(self, address: Address, authkey: bytes, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_handshakes: int = MAX_HANDSHAKES):
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._server = socket.create_server(address, family=family, backlog=128)
        self.address: Address = (address[0], self._server.getsockname()[1])
        self._authkey = authkey
        self._handshake_timeout_s = handshake_timeout_s
        self.max_handshakes = max_handshakes
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._joins: "queue.Queue[Any]" = queue.Queue()
        #: Names this controller's run in the ranks' store keys (with the pool's start number).
        self.token = uuid.uuid4().hex[:12]
        self.refused = RefusedPeers()
        self._lock = threading.Lock()  # guards _closed, _under_way, and the hand-over into _joins
        self._under_way: Dict[Handshake, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="conformance-listener")
        self._acceptor.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def handshakes_under_way(self) -> int:
        with self._lock:
            return len(self._under_way)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of file descriptors: let handshakes end rather than spin
                continue
            if not self._slots.acquire(blocking=False):
                sock.close()
                self._refuse(peer, f"arrived while {self.max_handshakes} handshakes were under way (the cap) and "
                                   "were closed at once")
                continue
            handshake = Handshake(sock, self._handshake_timeout_s)
            thread = threading.Thread(target=self._admit, args=(handshake, peer), daemon=True,
                                      name=f"conformance-admit-{peer[0]}")
            with self._lock:
                if self._closed:
                    handshake.close()
                    self._slots.release()
                    return
                self._under_way[handshake] = thread
            thread.start()

    def _refuse(self, peer: Peer, why: str) -> None:
        if self._closed:  # the run ended the handshake; the peer did nothing wrong
            return
        if self.refused.add(peer, why):
            log.warning("conformance --listen %s: refused a connection from %s: %s (further refusals are counted, and "
                        "summarised when the run ends)", format_address(self.address), format_address(peer[:2]), why)

    def _admit(self, handshake: Handshake, peer: Peer) -> None:
        try:
            self._handshake(handshake, peer)
        finally:
            with self._lock:
                self._under_way.pop(handshake, None)
            self._slots.release()

    def _handshake(self, handshake: Handshake, peer: Peer) -> None:
        try:
            handshake.authenticate(self._authkey)
        except AuthenticationError:
            handshake.close()
            self._refuse(peer, "did not know the shared secret (authentication failed)")
            return
        except HandshakeTimeout as exc:
            handshake.close()
            self._refuse(peer, f"did not finish authenticating: {exc}")
            return
        except (OSError, EOFError, AssertionError):  # answer_challenge asserts on a malformed challenge
            handshake.close()
            self._refuse(peer, "closed the connection or broke the protocol before authenticating")
            return
        try:
            kind, info = pickle.loads(handshake.recv_bytes(MAX_JOIN_BYTES))  # authenticated: it knows the secret
            if kind != Msg.JOIN or not isinstance(info, dict):
                raise ValueError(f"sent {kind!r} instead of join")
        except HandshakeTimeout as exc:
            handshake.close()
            self._refuse(peer, f"authenticated but sent no join message: {exc}")
            return
        except Exception:  # noqa: BLE001 - an authenticated peer that is no rank
            handshake.close()
            self._refuse(peer, "authenticated but is no conformance rank (no join message)")
            return
        info["peer"] = format_address(peer[:2])
        conn = handshake.connection()
        with self._lock:
            if not self._closed:
                self._joins.put((conn, info))
                return
        shutdown_rank(conn)  # joined as the run ended

    def next_join(self, timeout_s: float) -> Optional[Tuple[Connection, Dict[str, Any]]]:
        """The next authenticated rank as ``(Connection, join info)``, or ``None`` after ``timeout_s`` seconds."""
        try:
            return self._joins.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop listening, end every handshake under way, tell ranks that joined but were never used to shut down
        (they exit 0), and log the summary of refused peers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            under_way = dict(self._under_way)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._server.close()
        for handshake in under_way:
            handshake.abort()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in [self._acceptor, *under_way.values()]:
            thread.join(max(deadline - time.monotonic(), 0.0))
        while True:
            try:
                conn, _ = self._joins.get_nowait()
            except queue.Empty:
                break
            shutdown_rank(conn)
        summary = self.refused.summary()
        if summary is not None:
            log.warning("conformance --listen %s: %s", format_address(self.address), summary)


def shutdown_rank(conn: Connection) -> None:
    """Tell a rank to shut down (it exits 0) and close its connection; a rank already gone is fine."""
    try:
        send(conn, (Msg.SHUTDOWN, None))
        if conn.poll(2.0):
            recv(conn)
    except (OSError, EOFError):
        pass
    conn.close()
