"""The ``--listen`` listener under abuse: who gets in, how long anyone may take, and what the log says.

Unit tests on loopback, no torchrun and no torch.distributed, against
:class:`conformance.controller.remote_listener.RankListener` and
:func:`conformance.shared.remote_link.connect`: a peer without the key is refused and
nothing it sent is unpickled; a bounded flood of half-open connections meets the
cap on concurrent handshakes and a real rank still joins after it; a peer that
trickles bytes is dropped at one deadline for the whole handshake; closing the
listener ends every handshake under way; refusals are summarised, never logged
one line per peer.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from conformance.protocol import recv, send
from conformance.shared.remote_link import connect
from conformance.controller.remote_listener import RankListener, RefusedPeers

KEY = b"0123456789abcdef0123456789abcdef"
CAP_REASON = "arrived while {cap} handshakes were under way (the cap) and were closed at once"


@pytest.fixture
def make_listener():
    made = []

    def make(**kwargs):
        kwargs.setdefault("handshake_timeout_s", 0.5)
        made.append(RankListener(("127.0.0.1", 0), KEY, **kwargs))
        return made[-1]

    yield make
    for lis in made:
        lis.close()


@pytest.fixture
def listener(make_listener):
    return make_listener()


def _wait_for(predicate, timeout=20.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _join(address, rank=0, world_size=1):
    conn = Client(address, authkey=KEY)
    send(conn, ("join", {"rank": rank, "world_size": world_size}))
    return conn


def _closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end closed ``sock`` (an end of file or a reset) within ``wait_s`` seconds."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(4096):  # the challenge, then nothing
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


class _Marker:
    """Creates a file when unpickled: proof of whether the controller ran a pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- who gets in ---------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [0, 4096], ids=["small", "longer than a challenge answer"])
def test_an_unauthenticated_pickle_is_never_read(listener, tmp_path, caplog, padding):
    marker = tmp_path / ("ran" + "x" * padding)[:200]
    payload = pickle.dumps(("join", _Marker(str(marker)), b"x" * padding))
    with socket.create_connection(listener.address) as raw, caplog.at_level(logging.WARNING, "conformance.controller.remote"):
        port = raw.getsockname()[1]
        raw.sendall(struct.pack("!i", len(payload)) + payload)  # what Connection.send_bytes would frame
        _wait_for(lambda: len(listener.refused) == 1, what="the refusal")
    assert not marker.exists(), "the controller unpickled a message from a peer that never authenticated"
    assert listener.next_join(0.1) is None
    assert f"refused 1 connection from 1 host (127.0.0.1:{port}) at " in listener.refused.summary()
    assert f"refused a connection from 127.0.0.1:{port}" in caplog.text


def test_a_wrong_key_is_refused_and_the_listener_goes_on(listener):
    with pytest.raises(AuthenticationError):
        Client(listener.address, authkey=b"not the key, but long enough")
    _wait_for(lambda: len(listener.refused) == 1, what="the refusal")
    assert listener.refused.by_reason == {"did not know the shared secret (authentication failed)": 1}
    conn = _join(listener.address)
    got = listener.next_join(10.0)
    assert got is not None and got[1]["rank"] == 0 and got[1]["peer"].startswith("127.0.0.1:")
    send(got[0], ("hello", "both ends authenticated"))
    assert recv(conn) == ("hello", "both ends authenticated")
    conn.close()
    got[0].close()


def test_the_listener_binds_only_the_named_address(listener):
    assert listener._server.getsockname()[0] == "127.0.0.1"
    assert listener.address[1] == listener._server.getsockname()[1] != 0


# -- how long anyone may take --------------------------------------------------------------


def test_a_silent_peer_is_dropped_as_timed_out_and_does_not_block_the_others(listener):
    silent = socket.create_connection(listener.address)
    try:
        conn = _join(listener.address, rank=1, world_size=2)  # joins while the silent peer is still connected
        assert listener.next_join(10.0)[1]["rank"] == 1
        assert _closed_by_peer(silent, 20.0), "the listener should close a silent peer at its deadline"
        _wait_for(lambda: len(listener.refused) == 1, what="the refusal")
        assert listener.refused.by_reason == {"did not finish authenticating: timed out after 0.5 s": 1}
        assert "BlockingIOError" not in listener.refused.summary()
        conn.close()
    finally:
        silent.close()


def test_a_peer_that_trickles_bytes_is_dropped_at_one_deadline_for_the_whole_handshake(make_listener):
    """Every read comes within the timeout, but the handshake as a whole does not: it ends at 1 s."""
    listener = make_listener(handshake_timeout_s=1.0)
    with socket.create_connection(listener.address) as peer:
        peer.recv(4096)  # the challenge
        peer.sendall(struct.pack("!i", 200))  # announces an answer of 200 bytes, then sends one every 0.25 s
        started = time.monotonic()
        dropped = False
        for _ in range(200):
            try:
                peer.sendall(b"x")
            except OSError:
                dropped = True
                break
            if _closed_by_peer(peer, 0.25):
                dropped = True
                break
        held_s = time.monotonic() - started
    assert dropped, "a peer that sends a byte every 0.25 s was held for 50 s by a 1 s handshake timeout"
    assert held_s < 10.0, f"held {held_s:.1f} s by a 1 s handshake timeout"
    _wait_for(lambda: len(listener.refused) == 1, what="the refusal")
    assert listener.refused.by_reason == {"did not finish authenticating: timed out after 1 s": 1}


def test_an_authenticated_peer_that_never_joins_is_dropped_at_the_same_deadline(listener):
    conn = Client(listener.address, authkey=KEY)  # authenticates, then says nothing
    try:
        _wait_for(lambda: len(listener.refused) == 1, what="the refusal")
        assert listener.refused.by_reason == {"authenticated but sent no join message: timed out after 0.5 s": 1}
        assert listener.handshakes_under_way == 0
    finally:
        conn.close()


def test_closing_the_listener_ends_the_handshakes_under_way(make_listener):
    """No connection outlives the run: close() ends handshakes that still had 60 s, and blames no peer."""
    listener = make_listener(handshake_timeout_s=60.0)
    peers = [socket.create_connection(listener.address) for _ in range(3)]
    try:
        _wait_for(lambda: listener.handshakes_under_way == 3, what="3 handshakes under way")
        started = time.monotonic()
        listener.close()
        assert listener.handshakes_under_way == 0
        assert all(_closed_by_peer(p, 10.0) for p in peers)
        assert time.monotonic() - started < 10.0
        assert len(listener.refused) == 0, "a peer whose handshake the run ended did nothing wrong"
    finally:
        for p in peers:
            p.close()


# -- a bounded flood -----------------------------------------------------------------------


def test_a_flood_of_half_open_connections_meets_the_cap_and_a_rank_joins_after_it(make_listener, caplog):
    """100 silent connections on loopback: at most 8 handshakes (and threads) at once, the other 92
    closed at once and counted; a handful of log lines, one summary; then a real rank joins."""
    cap, flood = 8, 100
    listener = make_listener(handshake_timeout_s=60.0, max_handshakes=cap)
    threads_before = threading.active_count()
    peers = []
    with caplog.at_level(logging.WARNING, "conformance.controller.remote"):
        try:
            most_threads = 0
            for _ in range(flood):
                peers.append(socket.create_connection(listener.address))
                most_threads = max(most_threads, threading.active_count())
            _wait_for(lambda: len(listener.refused) == flood - cap, what=f"{flood - cap} refusals for the cap")
            assert listener.handshakes_under_way == cap
            most_threads = max(most_threads, threading.active_count())
            assert most_threads - threads_before <= cap
            assert listener.refused.by_reason == {CAP_REASON.format(cap=cap): flood - cap}
        finally:
            for p in peers:
                p.close()
        _wait_for(lambda: listener.handshakes_under_way == 0, what="the flood's handshakes to end")
        conn = _join(listener.address)
        got = listener.next_join(10.0)
        assert got is not None and got[1]["rank"] == 0, "after the flood a real rank must still get in"
        got[0].close()
        conn.close()
        listener.close()
    summary = listener.refused.summary()
    assert summary.startswith(f"refused {flood} connections from 1 host (127.0.0.1:")
    assert summary.count("127.0.0.1:") == 5 and ", ...) between " in summary
    assert f"{flood - cap} {CAP_REASON.format(cap=cap)}" in summary
    assert f"{cap} closed the connection or broke the protocol before authenticating" in summary
    lines = [r.getMessage() for r in caplog.records if r.name == "conformance.controller.remote"]
    assert len(lines) == 3, f"one line for the first refusal of each kind and one summary, not one per peer: {lines}"
    assert lines[-1].endswith(summary)


def test_a_rank_closed_for_the_cap_retries_and_joins(make_listener):
    listener = make_listener(handshake_timeout_s=60.0, max_handshakes=2)
    squatters = [socket.create_connection(listener.address) for _ in range(2)]
    _wait_for(lambda: listener.handshakes_under_way == 2, what="the cap to fill")
    joined = {}

    def rank():
        joined["conn"] = conn = connect(listener.address, KEY, timeout_s=30.0)
        send(conn, ("join", {"rank": 0, "world_size": 1}))

    thread = threading.Thread(target=rank)
    thread.start()
    _wait_for(lambda: len(listener.refused) >= 1, what="the rank to be closed for the cap")
    for s in squatters:
        s.close()
    thread.join(40.0)
    got = listener.next_join(10.0)
    assert got is not None and got[1]["rank"] == 0
    got[0].close()
    joined["conn"].close()


# -- the summary ---------------------------------------------------------------------------


def test_the_summary_counts_each_reason_and_names_the_first_peers():
    refused = RefusedPeers()
    assert refused.summary() is None
    firsts = [refused.add((f"10.0.0.{i % 2}", 4000 + i), "did not know the shared secret" if i < 5 else "timed out")
              for i in range(7)]
    assert firsts == [True, False, False, False, False, True, False]
    assert len(refused) == 7
    summary = refused.summary()
    assert summary.startswith("refused 7 connections from 2 hosts (10.0.0.0:4000, 10.0.0.1:4001, 10.0.0.0:4002, "
                              "10.0.0.1:4003, 10.0.0.0:4004, ...) between ")
    assert ": 5 did not know the shared secret; 2 timed out. Nothing was unpickled" in summary
