"""Measuring which of a hook's own code ran changes no result (issue 44): the same cases with ``--hook-coverage
on`` and ``off`` give the same outcome, figures, findings (with every value's bits) and named causes, case by
case, and only the measured run says which code ran.

The cases (``tests/meta_zoos/switches.py``, the default depth's runs of the switch zoo) mix what could be
disturbed: hooks that pass and hooks that fail with a diagnosis (DDP's arithmetic zoo at 3 ranks, an FSDP2 comm
with bfloat16 on the wire), hooks with branches and state of their own (the switch zoo), long runs, and the hooks
that exchange with ``dist.P2POp`` (the identity zoo). Both runs go in the zoo runs' background threads.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.meta_zoos import SWITCH_DEFAULT_RUNS


@pytest.fixture
def both(zoo_runs):
    return zoo_runs(SWITCH_DEFAULT_RUNS)


def _case(case: Dict[str, Any]) -> Dict[str, Any]:
    failure = case.get("failure") or {}
    return {"outcome": case["outcome"], "figures": case.get("figures"), "reach": case.get("reach"),
            "findings": failure.get("findings"), "causes": failure.get("causes"), "fixes": failure.get("fixes"),
            "skip_reason": case.get("skip_reason")}


def test_every_case_gives_the_same_result_with_and_without_the_measurement(both):
    (on_run, on), (off_run, off) = both["on"], both["off"]
    assert on_run.returncode == off_run.returncode == 1, (on_run.output[-2000:], off_run.output[-2000:])
    on_cases, off_cases = ({c["id"]: _case(c) for c in doc["cases"]} for doc in (on, off))
    assert set(off_cases) <= set(on_cases) and len(off_cases) >= 12  # the measured run has more: these are compared
    on_cases = {i: on_cases[i] for i in off_cases}
    assert {c["outcome"] for c in on_cases.values()} >= {"passed", "failed"}
    assert any(c["causes"] for c in on_cases.values())  # failures with a named cause, compared bit for bit
    differ = {i: (on_cases[i], off_cases[i]) for i in on_cases if on_cases[i] != off_cases[i]}
    assert not differ, differ


def test_only_the_measured_run_says_which_code_ran(both):
    on = {h["name"]: h["hook_code"] for h in both["on"][1]["hooks"] if h.get("counts")}
    assert len(on) >= 25  # the switch and identity zoos, and the samples of DDP's and FSDP2's
    off = {h["name"]: h["hook_code"] for h in both["off"][1]["hooks"] if h.get("counts")}
    assert all(code["measured"] for code in on.values()), {n: c["reason"] for n, c in on.items() if not c["measured"]}
    assert all(not code["measured"] and code["reason"] == "not measured: --hook-coverage off" for code in off.values())
    assert "hook code: n/a (not measured: --hook-coverage off)" in both["off"][0].output
