"""The authenticated link between the controller and ranks that torchrun started, on any node.

Shared by both ends: the controller (:mod:`conformance.controller.remote_listener`) listens, each
rank (:mod:`conformance.ranks.remote_worker`) connects. The protocol carries pickles,
and unpickling runs code, so neither end reads a message before the peer has
proved that it knows the run's shared secret: the challenge/response of the
standard library's :mod:`multiprocessing.connection` (``Client(authkey=...)``
on the rank; ``deliver_challenge`` then ``answer_challenge`` on the controller,
in the order ``Listener.accept`` uses them). Both ends authenticate each
other: a rank never unpickles from a controller without the key either.

On the controller, a :class:`Handshake` runs that challenge/response (and reads
the rank's first message) under **one deadline for the whole exchange**. A
socket timeout alone restarts with every read, so a peer that sends a byte
every few seconds would hold the connection for as long as it likes.

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

__all__ = ["AUTHKEY_ENV", "AUTHKEY_FILE_ENV", "Address", "Handshake", "HandshakeTimeout",
           "LinkError", "connect", "format_address", "parse_address", "read_authkey"]

AUTHKEY_FILE_ENV = "CONFORM_AUTHKEY_FILE"
AUTHKEY_ENV = "CONFORM_AUTHKEY"
#: Bytes below which a secret is refused: the challenge is an HMAC over the key, so a short
#: key is a guessable key. 16 bytes is what ``openssl rand -hex 16`` gives as 32 characters.
MIN_AUTHKEY_BYTES = 16
#: Seconds a connecting peer gets for its whole handshake (the challenge both ways, then its
#: first message). A peer that connects and stays silent, or trickles bytes (a port scanner, a
#: stuck client), is dropped at this deadline, never waited on.
HANDSHAKE_TIMEOUT_S = 10.0
#: Bytes of a handshake message: ``multiprocessing.connection`` frames each message with its
#: length as a 4-byte big-endian signed integer (``Connection._send_bytes``).
_FRAME = struct.Struct("!i")

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


class HandshakeTimeout(TimeoutError):
    """A peer did not finish its handshake by the deadline; the message is ``timed out after N s``."""


class Handshake:
    """The controller's side of one peer's handshake, on a socket just accepted, under one deadline.

    Offers the two methods that :func:`multiprocessing.connection.deliver_challenge`
    and ``answer_challenge`` call, ``send_bytes`` and ``recv_bytes``, with
    ``Connection``'s framing (a 4-byte big-endian length, then the bytes). Before
    every read and write the socket's timeout is set to what is left of
    ``timeout_s`` seconds counted from construction, so the deadline holds for
    the whole exchange however the peer paces its bytes. :meth:`abort`, from
    another thread, ends a handshake at once.

    Args:
        sock: the accepted socket; the handshake owns it (closes it, or hands it to
            :meth:`connection`).
        timeout_s: seconds for everything up to :meth:`connection`.
    """

    def __init__(self, sock: socket.socket, timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self._sock = sock
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(f"timed out after {self.timeout_s:g} s")
        self._sock.settimeout(left)

    def _recv_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            self._arm()
            try:
                chunk = self._sock.recv(size - len(data))
            except socket.timeout:
                raise HandshakeTimeout(f"timed out after {self.timeout_s:g} s") from None
            if not chunk:
                raise EOFError("the peer closed the connection" + (" in the middle of a message" if data else ""))
            data += chunk
        return bytes(data)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """One framed message of at most ``maxlength`` bytes (``Connection.recv_bytes``), before the deadline.

        Raises:
            HandshakeTimeout: the deadline passed.
            EOFError: the peer closed the connection.
            OSError: the frame announces more than ``maxlength`` bytes (they are not read).
        """
        size, = _FRAME.unpack(self._recv_exactly(_FRAME.size))
        if size < 0 or (maxlength is not None and size > maxlength):
            raise OSError(f"the peer announced a message of {size} bytes where at most {maxlength} are allowed "
                          "during the handshake")
        return self._recv_exactly(size)

    def send_bytes(self, data: bytes) -> None:
        """Send one framed message (``Connection.send_bytes``), before the deadline."""
        self._arm()
        try:
            self._sock.sendall(_FRAME.pack(len(data)) + bytes(data))
        except socket.timeout:
            raise HandshakeTimeout(f"timed out after {self.timeout_s:g} s") from None

    def authenticate(self, authkey: bytes) -> None:
        """Both ways, in ``multiprocessing.connection.Listener.accept``'s order; nothing is unpickled.

        Raises:
            AuthenticationError: the peer does not know ``authkey``.
            HandshakeTimeout, EOFError, OSError: as for :meth:`recv_bytes`.
        """
        deliver_challenge(self, authkey)  # type: ignore[arg-type]
        answer_challenge(self, authkey)  # type: ignore[arg-type]

    def connection(self) -> Connection:
        """The socket as a blocking ``Connection`` with no timeout; the handshake no longer owns it."""
        self._sock.settimeout(None)
        return Connection(self._sock.detach())

    def abort(self) -> None:
        """End the handshake now (from any thread): a read under way fails with ``EOFError``."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed, or handed to connection()
            pass

    def close(self) -> None:
        self._sock.close()


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
