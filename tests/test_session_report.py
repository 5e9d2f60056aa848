"""The run as a whole, as a newcomer reads it: the header's world sizes, what pytest's counts mean, and a ``-k``
that matched nothing.

Text from synthetic figures first, then a run whose ``-k`` selects nothing (no rank starts). The header, the
JSON's world sizes and the closing lines of a real run are checked in ``tests/test_newcomer.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conformance import HookSpec
from conformance.reports.session_report import counts_lines, no_case_lines

ENV = "torch 2.13.0+cpu, CPU build, gloo, cpu"


def test_counts_say_what_each_outcome_is_and_why_cases_were_deselected():
    lines = counts_lines({"passed": 233, "skipped": 7, "xfailed": 301}, 301,
                         {"test_lossy_error": ("fsdp", True),
                          "test_fsdp2_all_reduce_hook": ("fsdp2_all_reduce", False)},
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
def nothing(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "conformance", "--hook", "conformance.examples.my_specs:DDP_SPEC",
                           "-k", "no_such_case_xyz"], cwd=tmp_path_factory.mktemp("nothing"), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return proc.returncode, proc.stdout


def test_a_k_that_selects_nothing_says_so_and_lists_the_hooks_and_checks(nothing):
    rc, output = nothing
    assert rc == 5, output[-3000:]
    assert "no case matched -k 'no_such_case_xyz'" in output
    assert "hooks: my_ddp_mean" in output and "test_ddp_parity" in output


def test_the_header_gives_each_hook_the_fields_it_has_and_none_empty():
    """Issue 31: a DDP hook's header read ``[ddp; full-precision averaging; ]``: DDP has no sharding strategies."""
    from conformance.examples.my_specs import DDP_SPEC, SPEC
    from conformance.reports.session_report import spec_fields

    assert spec_fields(DDP_SPEC) == ["ddp", "full-precision averaging"]
    assert spec_fields(SPEC) == ["fsdp", "reduce_dtype=float16", "NO_SHARD, FULL_SHARD, SHARD_GRAD_OP"]
    compiled = HookSpec(name="c", api="ddp", hook=DDP_SPEC.hook, state=DDP_SPEC.state, compiled_ddp=True)
    assert spec_fields(compiled) == ["ddp", "full-precision averaging", "compiled DDP"]
    # A claimed parameter dtype: the API reduces in it unless a reduce dtype is claimed too (issue 30).
    bf16 = HookSpec(name="b", api="ddp", hook=DDP_SPEC.hook, state=DDP_SPEC.state, param_dtype=torch.bfloat16)
    assert spec_fields(bf16) == ["ddp", "averaging in the parameter dtype, param_dtype=bfloat16"]
    both = HookSpec(name="f", api="fsdp", hook=SPEC.hook, state=SPEC.state, reduce_dtype=torch.float32,
                    param_dtype=torch.bfloat16)
    assert spec_fields(both)[:2] == ["fsdp", "reduce_dtype=float32, param_dtype=bfloat16"]


def test_a_verdict_on_a_k_subset_says_it_covers_only_the_selected_cases():
    from conformance.reports.session_report import selection_note

    assert selection_note(1, 33, "test_ddp_averaging", "") == (
        "a verdict on the 1 case(s) -k 'test_ddp_averaging' selected, not on all 34 planned for this hook")
    assert "-k 'parity' and -m 'slow' selected" in selection_note(2, 1, "parity", "slow")
    assert selection_note(34, 0, "", "") == ""  # every planned case ran: a full verdict
