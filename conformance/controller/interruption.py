"""Stopping a run cleanly: SIGTERM is handled as Ctrl-C, and a stopping run finishes its report.

``timeout`` and CI cancellation send SIGTERM, whose default action ends the
controller on the spot: no report, and (before :mod:`conformance.ranks.lifeline`)
ranks left running. :class:`StopSignals` turns the first SIGINT or SIGTERM into
``KeyboardInterrupt``, which pytest turns into an interrupted session: the
pools are killed, the JUnit report is written, the summary says INTERRUPTED,
exit code 2. While that happens (well under a second once the pools are
killed), one more signal is only acknowledged, so an impatient second Ctrl-C
does not cut the report off; a third ends the controller at once, without a
report (its ranks follow it through their lifelines).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, Optional

__all__ = ["StopSignals", "SIGNALS_TO_FORCE"]

#: Signals after which the controller exits at once (``128 + signal``), skipping the report.
SIGNALS_TO_FORCE = 3


class StopSignals:
    """SIGINT and SIGTERM handlers for the controller (the pytest process).

    Attributes:
        received: signals received so far (0 while the run goes on).
        first: the first signal's number, or ``None``.
    """

    WATCHED = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)

    def __init__(self) -> None:
        self.received = 0
        self.first: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def install(self) -> bool:
        """Install the handlers; False (and nothing changed) outside the main thread, where Python allows none."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.WATCHED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers found by :meth:`install`. Idempotent."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            self.first = signum
            raise KeyboardInterrupt(f"{name} received")
        if self.received >= SIGNALS_TO_FORCE:
            os.write(2, f"\n[conformance] {name} again: stopping at once, no report is written\n".encode())
            os._exit(128 + signum)
        os.write(2, (f"\n[conformance] {name}: already stopping, the report is being written; "
                     f"send it again to stop at once without a report\n").encode())
