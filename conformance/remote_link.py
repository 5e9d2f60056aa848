"""The authenticated link between the controller and ranks that torchrun started, on any node.

Shared by both ends: the controller (:mod:`conformance.remote`) listens, each
rank (:mod:`conformance.remote_worker`) connects. The protocol carries pickles,
and unpickling runs code, so neither end reads a message before the peer has
proved that it knows the run's shared secret: the challenge/response of the
standard library's :mod:`multiprocessing.connection` (``Client(authkey=...)``
on the rank; ``deliver_challenge`` then ``answer_challenge`` on the controller,
in the order ``Listener.accept`` uses them). Both ends authenticate each
other: a rank never unpickles from a controller without the key either.

The secret (:func:`read_authkey`) comes from the file named by
``CONFORM_AUTHKEY_FILE`` (readable by its owner only) or from the variable
``CONFORM_AUTHKEY``; never from the command line, where ``ps`` shows it.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from multiprocessing.connection import AuthenticationError, Client, Connection, answer_challenge, deliver_challenge
from typing import Dict, Optional, Tuple

__all__ = ["AUTHKEY_ENV", "AUTHKEY_FILE_ENV", "Address", "AuthenticationError", "LinkError", "accept_authenticated",
           "connect", "format_address", "parse_address", "read_authkey"]

AUTHKEY_FILE_ENV = "CONFORM_AUTHKEY_FILE"
AUTHKEY_ENV = "CONFORM_AUTHKEY"
#: Bytes below which a secret is refused: the challenge is an HMAC over the key, so a short
#: key is a guessable key. 16 bytes is what ``openssl rand -hex 16`` gives as 32 characters.
MIN_AUTHKEY_BYTES = 16
#: Seconds a connecting peer gets to answer the challenge. A peer that connects and stays
#: silent (a port scanner, a stuck client) is dropped after this, never waited on.
HANDSHAKE_TIMEOUT_S = 10.0

Address = Tuple[str, int]


class LinkError(ValueError):
    """A bad address or secret for the controller link; the message names the source and the fix."""


def parse_address(text: str, source: str) -> Address:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) as ``(host, port)``.

    Raises:
        LinkError: no port, a port that is not an integer in 1..65535, or no
            host; the message names ``source`` (the option or variable).
    """
    text = str(text).strip()
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host:
        raise LinkError(f"invalid address {text!r} from {source}: expected HOST:PORT, e.g. 10.0.0.1:29600 "
                        "(an address of this node that the other nodes can reach, and a free port)")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise LinkError(f"invalid port {port!r} in {text!r} from {source}: expected an integer from 1 to 65535")
    return host, number


def format_address(address: Address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_authkey(env: Optional[Dict[str, str]] = None) -> bytes:
    """The run's shared secret, as bytes.

    From the file named by ``CONFORM_AUTHKEY_FILE`` (its content, surrounding
    whitespace stripped), else from ``CONFORM_AUTHKEY``. A file with any
    permission bit for its group or others is refused: whoever can read it
    could feed the controller pickles, whoever can write it could put in a
    secret of their own.

    Raises:
        LinkError: neither is set, the file is missing or unreadable, its group
            or others have any permission on it (the message says which, and
            ``chmod 600 FILE``), or the secret is shorter than
            :data:`MIN_AUTHKEY_BYTES`.
    """
    env = os.environ if env is None else env
    path = env.get(AUTHKEY_FILE_ENV, "").strip()
    if path:
        source = f"the file {path!r} ({AUTHKEY_FILE_ENV})"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise LinkError(f"cannot read the shared secret from {source}: {exc.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise LinkError(f"the shared secret in {source} is {_exposure(mode)} (mode {stat.filemode(mode)}, "
                                f"{stat.S_IMODE(mode):04o}); a secret must be readable and writable by its owner "
                                f"only: chmod 600 {path}")
            with os.fdopen(fd, "rb") as f:
                fd = -1
                key = f.read().strip()
        finally:
            if fd >= 0:
                os.close(fd)
    elif env.get(AUTHKEY_ENV, "").strip():
        source = AUTHKEY_ENV
        key = env[AUTHKEY_ENV].strip().encode()
    else:
        raise LinkError(
            f"no shared secret for the controller link: set {AUTHKEY_FILE_ENV} to a file only you can read, "
            f"e.g. (umask 077; openssl rand -hex 32 > ~/.conform-key) and {AUTHKEY_FILE_ENV}=~/.conform-key, "
            f"or set {AUTHKEY_ENV}, on the controller and on every node (never on the command line)")
    if len(key) < MIN_AUTHKEY_BYTES:
        raise LinkError(f"the shared secret from {source} has {len(key)} bytes; use at least {MIN_AUTHKEY_BYTES} "
                        "random bytes, e.g. openssl rand -hex 32")
    return key


def _exposure(mode: int) -> str:
    """Which permission bits of a key file are not its owner's, in words: ``'writable by its group'``."""
    said = []
    for what, group_bit, other_bit in (("readable", stat.S_IRGRP, stat.S_IROTH),
                                       ("writable", stat.S_IWGRP, stat.S_IWOTH),
                                       ("executable", stat.S_IXGRP, stat.S_IXOTH)):
        who = [name for name, bit in (("its group", group_bit), ("others", other_bit)) if mode & bit]
        if who:
            said.append(f"{what} by {' and '.join(who)}")
    return ", ".join(said)


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level receive/send timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``; 0 for none).

    ``Connection`` reads the raw descriptor, so ``socket.settimeout`` (which makes
    the descriptor non-blocking) would not do; these make a blocked read fail
    with ``OSError`` instead.
    """
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def accept_authenticated(sock: socket.socket, authkey: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """Authenticate a socket just accepted by the controller, then wrap it as a ``Connection``.

    Runs :func:`multiprocessing.connection.deliver_challenge` and
    ``answer_challenge`` (what ``Listener.accept`` runs) with a timeout of
    ``timeout_s`` seconds; nothing is unpickled. ``sock`` is consumed.

    Raises:
        AuthenticationError: the peer does not know the key.
        OSError, EOFError: the peer went away or stayed silent past the timeout.
    """
    _set_timeouts(sock, timeout_s)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        restored = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            _set_timeouts(restored, 0)
        finally:
            restored.close()
    except BaseException:
        conn.close()
        raise
    return conn


def connect(address: Address, authkey: bytes, timeout_s: float) -> Connection:
    """Connect to the controller at ``address`` and authenticate both ways (``multiprocessing.connection.Client``).

    Retries for up to ``timeout_s`` seconds while nothing listens there yet
    (the nodes may start before the controller).

    Raises:
        AuthenticationError: the controller rejected this rank's key, or does not know it.
        ConnectionError: nothing accepted a connection within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            return Client(address, authkey=authkey)
        except AuthenticationError:
            raise
        except (OSError, EOFError) as exc:
            if time.monotonic() + delay > deadline:
                raise ConnectionError(f"could not reach the conformance controller at {format_address(address)} "
                                      f"within {timeout_s:g} s: {exc}. Start it first (conform --listen "
                                      f"{format_address(address)} ...), and check the address and port") from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
