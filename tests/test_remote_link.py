"""The controller link for torchrun's ranks: the secret, the address, and a pool whose ranks never come.

Unit tests, no torchrun and no torch.distributed: :mod:`conformance.shared.remote_link`
(where the secret may come from, address parsing), the ``--listen`` settings,
and :class:`conformance.controller.remote.RemotePool` when torchrun's ranks do not connect
(:class:`conformance.controller.remote.RanksNotConnected`, a failure of the run). The
listener under abuse is in ``tests/test_listener.py``; the two-agent runs are in
``tests/test_torchrun.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import struct
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from conformance.protocol import recv, send
from conformance.controller.remote_listener import RankListener
from conformance.shared.remote_link import LinkError, parse_address, read_authkey
from conformance.ranks.remote_worker import without_own_threads
from conformance.controller.settings import resolve
from conformance.controller.options import OPTIONS, SettingsError

KEY = b"0123456789abcdef0123456789abcdef"


# -- the secret ----------------------------------------------------------------------------


def test_secret_from_a_private_file(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    assert read_authkey({"CONFORM_AUTHKEY_FILE": str(path)}) == KEY


@pytest.mark.parametrize("mode, said", [
    (0o620, "writable by its group (mode -rw--w----, 0620)"),
    (0o644, "readable by its group and others (mode -rw-r--r--, 0644)"),
    (0o604, "readable by others (mode -rw----r--, 0604)"),
    (0o666, "readable by its group and others, writable by its group and others (mode -rw-rw-rw-, 0666)"),
    (0o710, "executable by its group (mode -rwx--x---, 0710)"),
])
def test_a_key_file_that_is_not_private_is_refused_naming_the_bits_and_the_fix(tmp_path, mode, said):
    path = tmp_path / "key"
    path.write_bytes(KEY)
    path.chmod(mode)
    with pytest.raises(LinkError) as err:
        read_authkey({"CONFORM_AUTHKEY_FILE": str(path)})
    assert f"(CONFORM_AUTHKEY_FILE) is {said}; a secret must be readable and writable by its owner only: " \
           f"chmod 600 {path}" in str(err.value)


def test_secret_from_the_environment():
    assert read_authkey({"CONFORM_AUTHKEY": KEY.decode()}) == KEY


def test_no_secret_says_where_to_put_one():
    with pytest.raises(LinkError, match="set CONFORM_AUTHKEY_FILE to a file only you can read.*never on the command line"):
        read_authkey({})


def test_a_short_secret_is_refused():
    with pytest.raises(LinkError, match="has 5 bytes; use at least 16"):
        read_authkey({"CONFORM_AUTHKEY": "short"})


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(LinkError, match="cannot read the shared secret from the file .*nope"):
        read_authkey({"CONFORM_AUTHKEY_FILE": str(tmp_path / "nope")})


# -- the address ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("10.0.0.1:29600", ("10.0.0.1", 29600)),
                                            ("node-1.cluster:80", ("node-1.cluster", 80)),
                                            ("[::1]:5000", ("::1", 5000))])
def test_address(text, expected):
    assert parse_address(text, "--listen") == expected


@pytest.mark.parametrize("text, message", [("10.0.0.1", "expected HOST:PORT"), (":29600", "expected HOST:PORT"),
                                           ("h:0", "invalid port '0'"), ("h:http", "invalid port 'http'")])
def test_bad_address_names_its_source(text, message):
    with pytest.raises(LinkError, match=message) as err:
        parse_address(text, "--listen")
    assert "from --listen" in str(err.value)


# -- settings ------------------------------------------------------------------------------


def _resolve(env, **given):
    unset = {"conform_hooks": [], "conform_known_failures": []}

    def get(dest):
        assert dest in {o.dest for o in OPTIONS} | {"hypothesis_seed"}, dest
        return given.get(dest, unset.get(dest, None))

    return resolve(get, env, gpu_count=0, cores=2, memory=None)


def test_listen_needs_the_world_size():
    with pytest.raises(SettingsError, match="--listen needs --world-size N, the WORLD_SIZE of the torchrun job"):
        _resolve({"CONFORM_AUTHKEY": KEY.decode()}, conform_listen="127.0.0.1:29600")


def test_listen_needs_a_secret_before_anything_starts():
    with pytest.raises(SettingsError, match="no shared secret"):
        _resolve({}, conform_listen="127.0.0.1:29600", conform_world_size="2")


def test_listen_skips_other_world_sizes_with_the_reason():
    s = _resolve({"CONFORM_AUTHKEY": KEY.decode()}, conform_listen="127.0.0.1:29600", conform_world_size="16",
                 conform_device="cuda", conform_extra_world_size="3")
    assert s.listen == ("127.0.0.1", 29600) and s.world_size == 16 and s.device == "cuda", \
        "the nodes' GPUs are not this machine's: --listen must not check them here"
    assert s.world_size_unavailable(16) is None
    assert "the ranks are torchrun's (--listen), one group of --world-size 16" in s.world_size_unavailable(3)


def test_listen_drops_the_default_extra_world_size():
    s = _resolve({"CONFORM_AUTHKEY": KEY.decode()}, conform_listen="127.0.0.1:29600", conform_world_size="2")
    assert s.world_sizes == (2,)


# -- the listener (its abuse tests are in tests/test_listener.py) -----------------------------


@pytest.fixture
def listener():
    lis = RankListener(("127.0.0.1", 0), KEY, handshake_timeout_s=0.5)
    yield lis
    lis.close()


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- what a hung rank reports --------------------------------------------------------------


def test_stacks_leave_out_the_ranks_own_helper_threads():
    dump = ('printed by the hook\n'
            'Current thread 0x00007fab9d7276c0 (most recent call first):\n'
            '  File "/x/conformance/remote_worker.py", line 149 in _watch\n'
            '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
            '\n'
            'Thread 0x00007fab9df286c0 (most recent call first):\n'
            '  File "/x/conformance/remote_worker.py", line 85 in _copy\n'
            '\n'
            'Thread 0x00007fabc0637b80 (most recent call first):\n'
            '  File "/x/tests/zoo/contained.py", line 23 in hang_on_rank1\n')
    assert without_own_threads(dump) == ('printed by the hook\n'
                                         'Thread 0x00007fabc0637b80 (most recent call first):\n'
                                         '  File "/x/tests/zoo/contained.py", line 23 in hang_on_rank1\n')


def test_a_rank_outside_torchrun_says_how_to_start_it(capsys, monkeypatch):
    from conformance.ranks.remote_worker import EXIT_USAGE, main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CONFORM_AUTHKEY", KEY.decode())
    assert main(["--controller", "127.0.0.1:29600"]) == EXIT_USAGE
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in capsys.readouterr().err


# -- when torchrun's ranks do not come back ------------------------------------------------


def _stopped_pool(listener, restart_count, max_restarts):
    """A pool whose ranks (as they reported when they joined) were just stopped after a broken case."""
    pool = _new_pool(listener)
    pool.starts = 1
    pool._info = [{"rank": r, "host": "node0", "restart_count": restart_count, "max_restarts": max_restarts}
                  for r in range(2)]
    return pool


def _new_pool(listener, start_timeout_s=0.3):
    from conformance.controller.pools import PoolConfig
    from conformance.controller.remote import RemotePool

    return RemotePool(PoolConfig(world_size=2, backend="gloo", device="cpu", start_timeout_s=start_timeout_s),
                      listener)


def test_ranks_that_never_connect_are_a_failure_of_the_run_not_a_case(listener):
    """run() raises RanksNotConnected (a PoolStartError: the runner's run error), it returns no failed case."""
    from conformance.controller.pools import PoolStartError
    from conformance.protocol import Case
    from conformance.controller.remote import RanksNotConnected

    pool = _new_pool(listener)
    with pytest.raises(RanksNotConnected) as err:
        pool.run(Case(check="fsdp.parity", hook=None, params={}, case_id="test_averaging[my_ddp_mean]"))
    assert isinstance(err.value, PoolStartError)
    assert err.value.missing == [0, 1]
    assert str(err.value) == err.value.reason
    expected = (r"torchrun's ranks \[0, 1\] did not connect to 127\.0\.0\.1:\d+ within 0\.3 s \(--listen-timeout\): "
                r"start 'torchrun .* -m conformance\.worker --controller 127\.0\.0\.1:\d+' on every node, with the "
                r"same shared secret; no case ran on them$")
    assert re.match(expected, err.value.reason), err.value.reason
    started = time.monotonic()
    with pytest.raises(RanksNotConnected, match="did not connect"):
        pool.run(Case(check="fsdp.parity", hook=None, params={}, case_id="the next case"))
    assert time.monotonic() - started < 0.2, "a pool whose ranks never came must not wait again for every later case"


def test_ranks_with_another_secret_are_named_in_the_reason(listener):
    """Ranks started with another key reach the listener and are refused: the reason says so, not just 'absent'."""
    from conformance.controller.remote import RanksNotConnected

    with pytest.raises(AuthenticationError):
        Client(listener.address, authkey=b"another run's key, long enough")
    _wait_for(lambda: len(listener.refused) == 1)
    with pytest.raises(RanksNotConnected, match=r"no case ran on them\. Meanwhile the listener refused 1 connection "
                                                r"from 1 host \(127\.0\.0\.1:\d+\) at [\d:]+: 1 did not know the "
                                                r"shared secret \(authentication failed\)"):
        _new_pool(listener).start()


def test_no_rank_back_within_the_timeout_fails_this_start_and_every_later_one_at_once(listener):
    from conformance.controller.remote import RanksNotConnected

    pool = _stopped_pool(listener, restart_count=0, max_restarts=3)
    with pytest.raises(RanksNotConnected, match=r"ranks \[0, 1\] did not reconnect to 127.0.0.1:\d+ within 0.3 s "
                                                r"\(--listen-timeout\).*--max-restarts are exhausted") as err:
        pool.start()
    assert err.value.missing == [0, 1]
    started = time.monotonic()
    with pytest.raises(RanksNotConnected, match="did not reconnect"):
        pool.start()
    assert time.monotonic() - started < 0.2, "a pool whose ranks are gone must not wait again for every later case"


def test_spent_restarts_are_known_without_waiting(listener):
    from conformance.controller.remote import RanksNotConnected

    pool = _stopped_pool(listener, restart_count=2, max_restarts=2)
    pool.config = dataclasses.replace(pool.config, start_timeout_s=60.0)
    started = time.monotonic()
    with pytest.raises(RanksNotConnected, match=r"--max-restarts 2 are used up \(rank 0 on node0 ran as "
                                                r"TORCHELASTIC_RESTART_COUNT=2\).*Give torchrun more --max-restarts"):
        pool.start()
    assert time.monotonic() - started < 1.0


def test_a_rank_gone_before_the_hello_is_a_pool_start_error(listener):
    """A rank that joined and then reset its connection: a PoolStartError naming it, not a raw OSError."""
    from conformance.controller.pools import PoolConfig, PoolStartError
    from conformance.controller.remote import RemotePool

    rank = Client(listener.address, authkey=KEY)
    send(rank, ("join", {"rank": 0, "world_size": 1, "host": "node1", "pid": 4242}))
    _wait_for(lambda: listener._joins.qsize() == 1)
    with socket.socket(fileno=os.dup(rank.fileno())) as same:
        same.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    rank.close()
    time.sleep(0.2)
    pool = RemotePool(PoolConfig(world_size=1, backend="gloo", device="cpu", start_timeout_s=5.0), listener)
    with pytest.raises(PoolStartError, match=r"rank 0 \(pid 4242 on node1\) lost its connection before it joined "
                                             r"the process group"):
        pool.start()


def test_a_world_size_that_disagrees_with_the_flags_is_a_usage_error(listener):
    """torchrun started 4 ranks, the run planned 2: exit 4 naming both, and the rank is told why."""
    from conformance.controller.pools import PoolConfig
    from conformance.controller.remote import RemotePool

    rank = Client(listener.address, authkey=KEY)
    send(rank, ("join", {"rank": 3, "world_size": 4, "host": "node1"}))
    pool = RemotePool(PoolConfig(world_size=2, backend="gloo", device="cpu", start_timeout_s=10.0), listener)
    with pytest.raises(pytest.exit.Exception, match=r"usage error: torchrun started WORLD_SIZE=4 ranks \(rank 3 on "
                                                    r"node1 says so\), but this run plans cases at --world-size 2") as e:
        pool.start()
    assert e.value.returncode == pytest.ExitCode.USAGE_ERROR
    kind, reason = recv(rank)
    assert kind == "refused" and "run the controller with --world-size 4" in reason
    rank.close()
