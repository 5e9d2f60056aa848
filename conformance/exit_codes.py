"""The exit codes of a run, in one place (docs/nightly.md, "Using it as a nightly CI gate", lists them).

0 to 5 are pytest's own (:class:`pytest.ExitCode`); the suite adds one, :data:`RUN_ERROR`, for a
run that the suite itself could not carry out, so a CI job can tell "a hook is wrong" (1) from
"the suite could not finish its job here; nothing is known about the hooks it did not check" (10).
"""

from __future__ import annotations

import pytest

#: Every hook conforms (known failures allowed).
OK = int(pytest.ExitCode.OK)
#: A hook failed a check, a known failure lacks its entry, or a hook was checked at world size 1 only.
TESTS_FAILED = int(pytest.ExitCode.TESTS_FAILED)
#: Ctrl-C, SIGTERM, ``-x`` or ``--maxfail`` stopped the run before every case ran.
INTERRUPTED = int(pytest.ExitCode.INTERRUPTED)
#: A usage error: a bad hook spec or option, a report path that cannot be written or is held by another run.
USAGE_ERROR = int(pytest.ExitCode.USAGE_ERROR)
#: No case was selected (``-k`` or ``-m`` matched nothing).
NO_TESTS_COLLECTED = int(pytest.ExitCode.NO_TESTS_COLLECTED)
#: 10, not the next of pytest's codes: pytest 9 took 6 (``--max-warnings``), and may take more.
#: The run's own infrastructure failed: a rank pool that could not start, ranks that never connected
#: (``--listen``), a lost link to the ranks, or a report file that could not be written at the end. The
#: hooks it could not check read ``NOT RUN (reason)``, never ``DOES NOT CONFORM``.
RUN_ERROR = 10

#: Every exit status with its meaning in a few words, in order: what ``conform --help`` lists.
MEANINGS = (
    (OK, "every hook conforms (known failures allowed)"),
    (TESTS_FAILED, "a hook failed"),
    (INTERRUPTED, "interrupted"),
    (USAGE_ERROR, "usage error"),
    (NO_TESTS_COLLECTED, "no case matched -k or -m"),
    (RUN_ERROR, "the run could not check every hook (NOT RUN), no hook blamed"),
)
