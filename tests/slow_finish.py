"""A pytest plugin for the interruption tests: a run that finishes slowly, so a signal can land then.

Load it with ``-p tests.slow_finish`` and set ``CONFORM_TEST_SLOW_AT`` to
``report`` (the session's finish, while its reports are written) or ``close``
(``Runner.close``, where the rank pools and the zygote are closed), and
``CONFORM_TEST_SLOW_MARKER`` to a path: the run creates that file on getting
there, then waits ``CONFORM_TEST_SLOW_S`` seconds (default 3) before going on.
"""

from __future__ import annotations

import os
import time

import pytest


def _pause() -> None:
    open(os.environ["CONFORM_TEST_SLOW_MARKER"], "w").close()
    deadline = time.monotonic() + float(os.environ.get("CONFORM_TEST_SLOW_S", "3"))
    while time.monotonic() < deadline:  # short sleeps: a signal handler runs between them, as in real work
        time.sleep(0.05)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("CONFORM_TEST_SLOW_AT") != "close":
        return
    from conformance.controller.runner import Runner

    close = Runner.close

    def slow_close(self) -> None:
        _pause()
        close(self)
    Runner.close = slow_close


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("CONFORM_TEST_SLOW_AT") == "report":
        _pause()
