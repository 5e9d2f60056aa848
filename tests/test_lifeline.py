"""The lifelines that end a pool process when its controller is gone (conformance/ranks/lifeline.py).

Small child interpreters (no torch) stand in for a rank: one armed with the
parent-death signal, one with the socket watchdog while its main thread sleeps.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conformance.protocol import LOST_CONTROLLER_EXIT_CODE


def _wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                return True
        time.sleep(0.05)
    return False


def test_the_socket_watchdog_ends_a_process_stuck_in_its_main_thread():
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from conformance.ranks.lifeline import exit_when_closed
        exit_when_closed({theirs.fileno()})
        print("armed", flush=True)
        time.sleep(120)   # a hook that never returns
        """)], pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True)
    theirs.close()
    try:
        assert child.stdout.readline().strip() == "armed"
        started = time.monotonic()
        ours.close()  # the controller is gone
        assert child.wait(timeout=10) == LOST_CONTROLLER_EXIT_CODE
        assert time.monotonic() - started < 3
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_parent_death_signal_kills_a_grandchild_when_its_parent_dies():
    """A middle process (the controller) starts a child armed against it (a rank), then is SIGKILLed."""
    middle = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import sys, time; from conformance.ranks.lifeline import die_with_parent; "
            "assert die_with_parent(int(sys.argv[1])); print('armed', flush=True); time.sleep(120)",
            str(os.getpid())], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "armed"
        print(child.pid, flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(middle.stdout.readline())
        middle.kill()
        middle.wait()
        assert _wait_gone(rank, within_s=5), f"pid {rank} outlived its parent"
    finally:
        middle.kill()
        middle.wait()
