"""A pytest plugin for the report tests: a full disk when the run writes its final reports.

Load it with ``-p tests.report_fault`` and set ``CONFORM_TEST_FULL_DISK`` to a
report's file name (``r.json``): once the session finishes, flushing any file
whose name contains it to disk (``os.fsync``) fails with ``ENOSPC``, as it does
on a full disk, and so does pytest's own JUnit writer opening it. Progress
written while cases run is not affected. With ``CONFORM_TEST_FULL_DISK_AT=start``
the disk is full from the session's start on (the paths were checked, at
configure time, before that), so the placeholders cannot be written either.
"""

from __future__ import annotations

import errno
import os

import pytest

_real_fsync = os.fsync


def _full_disk_fsync(name: str):
    def fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if name in os.path.basename(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        _real_fsync(fd)
    return fsync


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("CONFORM_TEST_FULL_DISK_AT") == "start":
        _fill_disk()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("CONFORM_TEST_FULL_DISK_AT", "finish") == "finish":
        _fill_disk()


def _fill_disk() -> None:
    name = os.environ.get("CONFORM_TEST_FULL_DISK")
    if not name:
        return
    os.fsync = _full_disk_fsync(name)
    import _pytest.junitxml

    def open_for_junit(path, *args, **kwargs):  # shadows the builtin in pytest's JUnit writer only
        if name in os.path.basename(str(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, *args, **kwargs)
    _pytest.junitxml.open = open_for_junit
