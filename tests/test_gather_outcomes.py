"""How long the controller waits for a case's ranks (``conformance.controller.pools.gather_outcomes``): until
they make no progress for the case timeout, not a fixed time.

A 2,000-step long run at 4 ranks on a loaded 2-core machine took more than the default 60 s, and the nightly
run of PyTorch's own replica hook reported it NOT RUN ("a rank hung during 'step 1692 of 2000'"), exit status
10. A rank announces a phase for every training step, so a slow case keeps announcing and a hung one stops.
Here the ranks are threads at the other end of pipes: a phase message, or the local pool's shared pages read
through ``progress``, is progress; silence for the timeout ends the wait, and so does the cap of
``MAX_TIMEOUTS_PER_CASE`` timeouts for a case that never ends.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe
from typing import Callable, Dict, List

import pytest

from conformance.controller.pools import MAX_TIMEOUTS_PER_CASE, gather_outcomes
from conformance.protocol import Msg, RankOutcome, send

TIMEOUT_S = 0.3


def _ranks(n: int, body: Callable[[int, object], None]) -> List[object]:
    """``n`` controller ends of pipes, each rank's end driven by ``body(rank, conn)`` in a daemon thread."""
    controller_ends = []
    for rank in range(n):
        mine, theirs = Pipe()
        controller_ends.append(mine)
        threading.Thread(target=body, args=(rank, theirs), daemon=True).start()
    return controller_ends


def _gather(conns, **kw) -> Dict[int, RankOutcome]:
    outcomes: Dict[int, RankOutcome] = {}
    gather_outcomes(conns, outcomes, TIMEOUT_S, lambda rank, phase: RankOutcome(rank=rank, phase=phase), **kw)
    return outcomes


def test_a_case_that_announces_its_steps_is_waited_for_past_the_timeout():
    def rank(r, conn):
        for step in range(10):  # 1 s in all, a step every 0.1 s
            send(conn, (Msg.PHASE, f"step {step} of 10"))
            time.sleep(0.1)
        send(conn, (Msg.OUTCOME, RankOutcome(rank=r, ok=True)))

    outcomes = _gather(_ranks(2, rank))
    assert sorted(outcomes) == [0, 1] and all(o.ok for o in outcomes.values())


def test_progress_read_from_the_local_pool_s_pages_counts_too():
    start = time.monotonic()

    def rank(r, conn):
        time.sleep(4 * TIMEOUT_S)
        send(conn, (Msg.OUTCOME, RankOutcome(rank=r, ok=True)))

    # The phase the pages hold changes every 0.1 s, as a rank's does when it announces each step there.
    outcomes = _gather(_ranks(2, rank), progress=lambda: int((time.monotonic() - start) / 0.1))
    assert sorted(outcomes) == [0, 1]


@pytest.mark.parametrize("pages", [None, lambda: "step 3 of 10"])
def test_a_silent_case_is_given_up_after_the_timeout(pages):
    def rank(r, conn):
        send(conn, (Msg.PHASE, "step 3 of 10"))
        if r == 0:
            send(conn, (Msg.OUTCOME, RankOutcome(rank=r, ok=True)))
        time.sleep(30)

    started = time.monotonic()
    outcomes = _gather(_ranks(2, rank), progress=pages)
    waited = time.monotonic() - started
    assert sorted(outcomes) == [0], outcomes
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S * 3, waited


def test_a_case_that_never_ends_is_given_up_after_the_cap():
    stop = threading.Event()

    def rank(r, conn):
        step = 0
        while not stop.is_set():
            send(conn, (Msg.PHASE, f"step {step}"))
            step += 1
            time.sleep(0.05)

    started = time.monotonic()
    outcomes = _gather(_ranks(1, rank))
    waited = time.monotonic() - started
    stop.set()
    assert outcomes == {}
    assert MAX_TIMEOUTS_PER_CASE * TIMEOUT_S * 0.9 <= waited < MAX_TIMEOUTS_PER_CASE * TIMEOUT_S + 2, waited
