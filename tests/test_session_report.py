"""The run as a whole, as a newcomer reads it: the header's world sizes, what pytest's counts mean, and a ``-k``
that matched nothing.

Text from synthetic figures first, then two small runs of the suite: one that selects nothing (no rank
starts), and one with a built-in hook's known failure beside a pass, with ``--json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance.session_report import counts_lines, no_case_lines

ENV = "torch 2.13.0+cpu, CPU build, gloo, cpu"


def test_counts_say_what_each_outcome_is_and_why_cases_were_deselected():
    lines = counts_lines({"passed": 233, "skipped": 7, "xfailed": 301}, 301,
                         {"test_lossy_error": ("fsdp", True), "test_fsdp2_all_reduce_hook": ("fsdp2_all_reduce", False)},
                         0, {2: {"test_parity"}, 3: {"test_parity"}, 4: {"test_subgroup_parity"}}, (2, 3), ENV)
    text = "\n".join(lines)
    assert lines[0].startswith("233 passed: ")
    assert f"301 xfailed: known failures of PyTorch's own built-in hooks on this build ({ENV})" in text
    assert "they do not fail the run" in text and "7 skipped: cases that cannot run here" in text
    deselected = next(line for line in lines if "deselected" in line)
    assert deselected.startswith("2 deselected: 2 suite test(s) with no case for the hooks under test, not a -k")
    assert "every test of api fsdp2_all_reduce (no hook under test has that api)" in deselected
    assert "test_lossy_error (its plan takes none of the fsdp hooks under test)" in deselected
    assert lines[-1] == "world sizes: the cases ran at 2, 3 and 4 (4 for test_subgroup_parity)"


def test_known_failures_of_a_user_s_hooks_are_not_called_pytorch_s():
    text = "\n".join(counts_lines({"passed": 1, "xfailed": 3}, 1, {}, 5, {2: {"t"}}, (2,), ENV))
    assert "1 xfailed: known failures of PyTorch's own built-in hooks" in text
    assert "2 xfailed: known failures of your hooks" in text
    assert "5 deselected: 5 case(s) by -k or -m" in text


def test_no_case_lines_name_the_selection_the_hooks_and_the_checks():
    lines = no_case_lines("parity and ws9", "", ["test_ddp_parity[h-default-net-ws2]",
                                                  "test_ddp_averaging[h-default-analytic_linear-ws2]"], ["h", "g"], 3)
    assert lines[0].startswith("no case matched -k 'parity and ws9': all 2 cases were deselected")
    assert "the other 3 deselected are suite tests with no case for these hooks" in lines[0]
    assert lines[1] == "  hooks: h, g"
    assert lines[2] == "  checks (suite tests): test_ddp_averaging, test_ddp_parity"
    assert "e.g. test_ddp_averaging[h-default-analytic_linear-ws2]" in lines[3]


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    return subprocess.Popen([sys.executable, "-m", "conformance", "-p", "no:randomly", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("session_report")
    procs = {
        "nothing": _run(["--hook", "conformance.examples.my_ddp_hook:SPEC", "-k", "no_such_case_xyz"], str(work)),
        # a pass and a known failure of a built-in hook (fp16_compress_hook raises on CPU), at 2 ranks alone
        "builtins": _run(["--device", "cpu", "--backend", "gloo", "--extra-world-size", "0", "--json",
                          str(work / "r.json"), "-k", "test_averaging and NO_SHARD and (allreduce_hook or "
                          "fp16_compress_hook) and not ddp_"], str(work)),
    }
    out = {key: (proc.wait(timeout=300), proc.stdout.read()) for key, proc in procs.items()}
    out["json"] = json.loads((work / "r.json").read_text()) if (work / "r.json").exists() else None
    return out


def test_a_k_that_selects_nothing_says_so_and_lists_the_hooks_and_checks(runs):
    rc, output = runs["nothing"]
    assert rc == 5, output[-3000:]
    assert "no case matched -k 'no_such_case_xyz'" in output
    assert "hooks: my_ddp_mean" in output and "test_ddp_parity" in output


def test_the_header_and_the_json_name_every_world_size_the_cases_need(runs):
    rc, output = runs["builtins"]
    header = next(line for line in output.splitlines() if line.startswith("conformance: torch"))
    assert "world sizes 2 and 4 (4 for " in header and "test_subgroup_parity" in header, header
    assert runs["json"]["environment"]["world_sizes"] == [2, 4]


def test_the_closing_lines_say_what_the_counts_are(runs):
    rc, output = runs["builtins"]
    assert rc == 0, output[-3000:]
    counts = output.split("what the counts mean", 1)[1]
    assert "1 passed: " in counts
    assert "1 xfailed: known failures of PyTorch's own built-in hooks on this build" in counts
    assert "deselected: " in counts and "case(s) by -k or -m" in counts
    assert "world sizes: the cases ran at 2\n" in counts
