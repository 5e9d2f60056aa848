"""Stopping a run cleanly: SIGTERM is handled as Ctrl-C, and no later signal can cut the report off.

``timeout`` and CI cancellation send SIGTERM, whose default action ends the
controller on the spot: no report, and (before :mod:`conformance.ranks.lifeline`)
ranks left running. :class:`StopSignals` turns the first SIGINT or SIGTERM
into ``KeyboardInterrupt``, which pytest turns into an interrupted session:
the pools are killed, the reports are written, the summary says INTERRUPTED,
exit code 2.

Every later signal, however many and whenever they land, is only
acknowledged: a ``KeyboardInterrupt`` raised while the pools close or the
reports are written would end the controller by SIGINT (exit status -2), with
no report or half of one, and stopping takes only a second or two once the
pools are killed. A first signal that arrives once the run is finishing
(:meth:`StopSignals.finishing`: every case has run, the reports are being
written) is only acknowledged too: the run's reports and exit code stand, and
agree with each other. To stop at once without a report, send SIGKILL (``kill -9``) or SIGQUIT
(Ctrl-\\); the ranks follow the controller through their lifelines.

A third signal does not stop the run at once either: a CI runner that escalates
sends SIGKILL, which no handler sees anyway, and a person pressing Ctrl-C again
and again still gets the report.

The ``conform`` command installs the handlers for the whole life of its
process (:func:`process_signals`), so a signal before pytest has configured the
session or after it has unconfigured it is handled too; a pytest session run
another way installs its own (:func:`session_signals`) and restores the
previous ones at its end.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from types import FrameType

__all__ = ["StopSignals", "process_signals", "session_signals"]


class StopSignals:
    """SIGINT and SIGTERM handlers for the controller (the pytest process).

    Attributes:
        received: signals received so far (0 while the run goes on).
        first: the first signal's number, or ``None``.
        interrupted: the first signal raised ``KeyboardInterrupt`` (it arrived before :meth:`finishing`).
    """

    WATCHED = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)

    def __init__(self) -> None:
        self.received = 0
        self.first: Optional[int] = None
        self.interrupted = False
        self._finishing = False
        self._previous: Dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

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

    def ignore(self) -> None:
        """Ignore the signals from now on: for a process about to exit (``conform`` once its run is over).

        Python's shutdown puts the default action back for every signal with a Python handler, so a
        signal landing then would end the process by it (exit status -2) after the run's report said
        otherwise; an ignored signal is left ignored. Main thread only, like :meth:`install`.
        """
        if threading.current_thread() is threading.main_thread():
            for sig in self.WATCHED:
                signal.signal(sig, signal.SIG_IGN)

    def finishing(self) -> None:
        """From now on a signal is only acknowledged: every case has run and the reports are being written."""
        self._finishing = True

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            self.first = signum
            if not self._finishing:
                self.interrupted = True
                raise KeyboardInterrupt(f"{name} received")
        doing = ("already stopping: the ranks are being stopped and the report written" if self.interrupted else
                 "the run is finishing: its report is being written, and stands")
        os.write(2, (f"\n[conformance] {name}: {doing}. To stop at once without a report, send SIGKILL "
                     f"(kill -9 {os.getpid()}) or press Ctrl-\\\n").encode())


_PROCESS: Optional[StopSignals] = None


def process_signals() -> StopSignals:
    """The handlers of this process, installed on the first call and never restored (the ``conform``
    command: the process ends with the run). In a thread other than the main one nothing is installed."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = StopSignals()
        _PROCESS.install()
    return _PROCESS


def session_signals() -> Tuple[StopSignals, bool]:
    """The handlers for one pytest session, and whether the session owns them (and restores them at its end).

    The process's own (:func:`process_signals`) where ``conform`` installed them; else new ones, installed now.
    """
    if _PROCESS is not None and _PROCESS.installed:
        return _PROCESS, False
    signals = StopSignals()
    return signals, signals.install()
