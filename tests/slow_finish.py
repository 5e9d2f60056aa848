"""A pytest plugin for the interruption tests: a run that finishes slowly, so a signal can land then.

Load it with ``-p tests.slow_finish`` and set ``CONFORM_TEST_SLOW_AT`` to
``report`` (the session's finish, while its reports are written) or ``close``
(``Runner.close``, where the rank pools and the zygote are closed), and
``CONFORM_TEST_SLOW_MARKER`` to a path: the run creates that file on getting
there, then waits before going on: until the file ``CONFORM_TEST_SLOW_UNTIL`` exists
(the test creates it once its signals are sent), for at most ``CONFORM_TEST_SLOW_S``
seconds (default 3; 60 when it waits for that file).
"""

from __future__ import annotations

import os
import time

import pytest


def _pause() -> None:
    open(os.environ["CONFORM_TEST_SLOW_MARKER"], "w").close()
    until = os.environ.get("CONFORM_TEST_SLOW_UNTIL")
    deadline = time.monotonic() + float(os.environ.get("CONFORM_TEST_SLOW_S", "60" if until else "3"))
    # Short sleeps: a signal handler runs between them (and interrupts them), as in real work.
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
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
