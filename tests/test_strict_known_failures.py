"""``--strict-known-failures`` fails a run for stale entries only: an entry that could apply to this run.

An entry whose every pattern names a world size (``...-ws3]``) cannot match a run without cases of that world
size (``--extra-world-size 0``, every ``--listen`` run by default): it is not stale there. Collection alone
(``--co``) is enough to judge the entries, so the runs here start no rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conformance.controller.known_failures import KnownFailure, KnownFailureBook, RunEnvironment

ENV = RunEnvironment(backend="gloo", device="cpu", torch_version="2.13.0")


def entry(*tests: str, hook: str = "h") -> KnownFailure:
    return KnownFailure(test=tests, reason="r", source=f"f#{tests[0]}", hook=hook)


def test_the_world_sizes_of_an_entry_are_those_its_patterns_end_with():
    assert entry("test_parity[h-*-ws3]", "test_x[h-*-ws5]").world_sizes() == {3, 5}
    assert entry("test_parity[h-*-ws3]", "test_x[h-*]").world_sizes() is None  # one pattern fits any size
    assert entry("test_registration[h-FULL_SHARD-twice]").world_sizes() is None
    assert entry("test_parity[h-*-ws*]").world_sizes() is None


def test_an_unmatched_entry_about_world_sizes_the_run_lacks_is_not_stale():
    ws3, anywhere, ws2 = entry("test_parity[h-*-ws3]"), entry("test_parity[h-nothing-*]"), entry("t[h-*-ws2]")
    book = KnownFailureBook([ws3, anywhere, ws2], ENV)
    assert book.unused(["h"], world_sizes=[2]) == [anywhere, ws2]
    assert book.unused(["h"], world_sizes=[2, 3]) == [ws3, anywhere, ws2]
    assert book.unused(["h"]) == [ws3, anywhere, ws2]  # no world sizes given: every entry counts


def _collect(*args: str, cwd: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    return subprocess.Popen([sys.executable, "-m", "conformance", "--co", "-q", "--strict-known-failures",
                             "--extra-world-size", "0", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The default run's collection at world size 2 alone, with the packaged file, and with a file of one's own
    that holds an entry about 3 ranks and a stale entry; both run at once."""
    work = tmp_path_factory.mktemp("strict")
    (work / "mine.toml").write_text(textwrap.dedent('''
        [[failure]]
        hook = "ddp_allreduce_hook"
        test = "test_ddp_parity[ddp_allreduce_hook-small_buckets-*-ws3]"
        reason = "about 3 ranks only"

        [[failure]]
        hook = "ddp_allreduce_hook"
        test = "test_ddp_parity[ddp_allreduce_hook-no_such_config-*]"
        reason = "stale: no such config"
    '''))
    procs = {"packaged": _collect(cwd=str(work)), "mine": _collect("--known-failures", "mine.toml", cwd=str(work))}
    out = {}
    for key, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        out[key] = (proc.returncode, text)
    return out


def test_a_run_without_three_ranks_is_not_failed_by_the_packaged_ws3_entries(runs):
    rc, output = runs["packaged"]
    assert rc == 0, output[-3000:]
    assert "matches no test" not in output and "match no test" not in output, output[-3000:]


def test_a_stale_entry_still_fails_the_run_and_the_ws3_entry_is_not_listed(runs):
    rc, output = runs["mine"]
    assert rc == 1, output[-3000:]
    listed = output.split("known-failures entries that match no test (--strict-known-failures)", 1)[1]
    assert "mine.toml#failure[1]" in listed
    assert "mine.toml#failure[0]" not in listed and "known_failures.toml#failure[2]" not in listed, listed
