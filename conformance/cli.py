"""``conform`` / ``python -m conformance``: run the conformance suite.

Conformance options (``--hook``, ``--world-size``, ``--backend``, ``--device``,
...; see ``conform --help``) and any pytest argument (``-k``, ``-x``, ``-q``,
``--junitxml``) may be mixed. The exit code is pytest's: 0 every hook
conforms (known failures allowed), 1 a hook failed a check, 4 a usage error
such as a bad hook spec.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

SUITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite")


def pytest_args(argv: List[str]) -> List[str]:
    """The pytest command line ``conform argv`` runs.

    The suite's own ``pytest.ini`` is used (``-c``), with the suite directory
    as rootdir, so the caller's project configuration does not leak in.
    """
    return ["-c", os.path.join(SUITE_DIR, "pytest.ini"), "--rootdir", SUITE_DIR,
            "-p", "conformance.pytest_plugin", *argv, SUITE_DIR]


#: Arguments after which no case runs, so no rank is needed.
_NO_CASES = {"-h", "--help", "--version", "--co", "--collect-only", "--fixtures", "--markers"}


def main(argv: Optional[List[str]] = None) -> int:
    """Run the suite; the exit code. Meant to be the process's last act: SIGINT and SIGTERM are handled
    from the start (:func:`conformance.interruption.process_signals`) and ignored once the run is over."""
    from conformance.exit_codes import INTERRUPTED
    from conformance.interruption import process_signals

    # Ctrl-C and SIGTERM are handled from here to the process's end, not only while pytest's session is
    # configured: one landing before it starts or while it closes would otherwise end the run by SIGINT.
    signals = process_signals()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not _NO_CASES.intersection(argv):
            # The zygote imports torch for the ranks while this process imports it for itself.
            from conformance.pool import start_zygote

            start_zygote()
        import pytest

        return int(pytest.main(pytest_args(argv)))
    except KeyboardInterrupt:  # the first signal, before pytest's session began: no case ran, no report changed
        return INTERRUPTED
    finally:
        signals.ignore()  # the run is over and its exit code decided: the process only exits now


if __name__ == "__main__":
    sys.exit(main())
