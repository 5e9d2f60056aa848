"""Files the suite writes whole: a report, a known-failures draft, a reproducer (standard library only)."""

from __future__ import annotations

import os
import tempfile

__all__ = ["write_atomic"]


def write_atomic(path: str, text: str, *, executable: bool = False) -> str:
    """Write ``text`` (UTF-8) to ``path`` so that a reader sees the old file or the new one, never half; return
    ``path``.

    The text goes to a temporary file in the same directory, is flushed to disk (``os.fsync``), then renamed over
    ``path`` (``os.replace``, atomic on POSIX and Windows within one file system). The file gets the permissions of
    a file opened for writing (0o666 less the umask; 0o777 less it where ``executable``: a reproducer that runs as
    ``./FILE.py``), not ``mkstemp``'s 0o600.

    Raises:
        OSError: the directory is not writable, the disk is full, ...; ``path`` is then unchanged and no temporary
            file is left behind.
    """
    path = os.path.abspath(path)
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, (0o777 if executable else 0o666) & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
