"""A rank's output and memory are bounded, and the case that exceeds a bound is the one named.

Runs the suite over ``tests/zoo/contained.py:UNRULY``: a hook that prints 3 MB on
every rank and raises (``--rank-log-limit 1`` MiB), one whose rank 1 keeps 200 MiB
(``--rank-memory-growth 64`` MiB, counted over the hook's cases), then PyTorch's plain ``allreduce_hook``.
"""

from __future__ import annotations

import re

import pytest

from tests.meta_helpers import run_suite


@pytest.fixture(scope="module")
def unruly_run(tmp_path_factory):
    junit = str(tmp_path_factory.mktemp("unruly") / "unruly.xml")
    return run_suite(["--hook", "tests.zoo.contained:UNRULY", "--extra-world-size", "0", "--rank-log-limit", "1",
                      "--rank-memory-growth", "64", "-k", "test_averaging", "-q"], junit, timeout=300)


def _case(run, hook):
    return next(c for c in run.cases if c.hook == hook)


def test_a_failure_says_how_much_rank_output_it_leaves_out(unruly_run):
    case = _case(unruly_run, "zoo_noisy")
    assert case.outcome == "failed", unruly_run.output[-3000:]
    assert "RuntimeError: noisy hook gives up" in case.message
    assert "noisy hook starts" in case.message, "the start of the case's output is kept"
    cut = [int(n) for n in re.findall(r"\.\.\. (\d+) bytes of rank output cut \.\.\.", case.message)]
    # Each rank printed 48 lines of 65536 bytes after its first line; the failure shows about 3000 of them.
    assert cut and all(48 * 65536 - 3000 < n < 48 * 65536 for n in cut), cut


def test_the_hook_whose_rank_grew_fails_with_the_growth_named_in_its_own_verdict(unruly_run):
    case = _case(unruly_run, "zoo_leak_once")
    assert case.outcome == "failed", unruly_run.output[-3000:]
    grew = set(re.findall(r"\[rank (\d)\] resident memory grew by (\d+) MiB \(to \d+ MiB\) over this hook's 1 case\(s\) "
                      r"on this rank, beyond --rank-memory-growth 64 MiB", case.message))
    assert [r for r, _ in grew] == ["1"] and 150 <= int(grew.pop()[1]) <= 260, case.message
    assert re.search(r"^zoo_leak_once +DOES NOT CONFORM \(memory growth\)", unruly_run.output, re.MULTILINE)


def test_the_cases_after_them_still_pass(unruly_run):
    assert _case(unruly_run, "zoo_plain_allreduce").outcome == "passed"
    assert unruly_run.returncode == 1  # zoo_noisy does not conform
