"""Measuring which of a hook's own code ran changes no result (issue 44): the same cases with ``--hook-coverage
on`` and ``off`` give the same outcome, figures, findings (with every value's bits) and named causes, case by
case, and only the measured run says which code ran.

The cases mix what could be disturbed: hooks that pass and hooks that fail with a diagnosis (DDP's arithmetic
zoo at 3 ranks, an FSDP2 comm with bfloat16 on the wire), hooks with branches and state of their own (the switch zoo), a long run, and the
hooks that exchange with ``dist.P2POp`` (the identity zoo). Both runs go in the zoo runs' background threads.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest

from tests.meta_helpers import BackgroundJob, run_suite

HOOKS = ("tests.zoo.ddp_hooks.good:KNOWN_GOOD", "tests.zoo.ddp_hooks.arithmetic:KNOWN_BAD",
         "tests.zoo.fsdp2_comms.reduce_scatter:KNOWN_GOOD", "tests.zoo.param_dtype_hooks:KNOWN_BAD",
         "tests.zoo.switch_hooks:KNOWN_BAD", "tests.zoo.identity_hooks:ALL")
SELECTION = ("(test_ddp_parity and default-nested_wrapped-ws3 and (good_mean_allreduce- or good_state_object "
             "or bad_sum_then_divide or bad_stale_second_step or bad_rank_order_mean or bad_ring_no_average_tail)) "
             "or (test_fsdp2_parity and default-nested_wrapped-ws2 and (good_plain_instance or good_async_wait "
             "or bad_bf16_wire_params_fp32)) "
             "or (bad_ddp_warm_large_bf16 and long_run and ws2) "
             "or (p2p_exchange and parity and (ws2 or ws4) and not ws3)")


def _runs(runs: object, directory: str, env: Dict[str, str]) -> Dict[str, Any]:
    out = {}
    for coverage in ("on", "off"):
        path = os.path.join(directory, f"coverage_{coverage}.json")
        args = [a for h in HOOKS for a in ("--hook", h)]
        run = run_suite([*args, "-q", "-k", SELECTION, "--hook-coverage", coverage, "--json", path],
                        os.path.join(directory, f"coverage_{coverage}.xml"), timeout=900, env=env)
        with open(path, encoding="utf-8") as f:
            out[coverage] = (run, json.load(f))
    return out


#: Both runs, in the zoo runs' background threads (``tests/conftest.py``).
BITS_RUNS = BackgroundJob("hook_coverage_on_off", _runs)


@pytest.fixture(scope="module")
def both(zoo_runs):
    return zoo_runs(BITS_RUNS)


def _case(case: Dict[str, Any]) -> Dict[str, Any]:
    failure = case.get("failure") or {}
    return {"outcome": case["outcome"], "figures": case.get("figures"), "reach": case.get("reach"),
            "findings": failure.get("findings"), "causes": failure.get("causes"), "fixes": failure.get("fixes"),
            "skip_reason": case.get("skip_reason")}


def test_every_case_gives_the_same_result_with_and_without_the_measurement(both):
    (on_run, on), (off_run, off) = both["on"], both["off"]
    assert on_run.returncode == off_run.returncode == 1, (on_run.output[-2000:], off_run.output[-2000:])
    on_cases, off_cases = ({c["id"]: _case(c) for c in doc["cases"]} for doc in (on, off))
    assert set(on_cases) == set(off_cases) and len(on_cases) >= 20
    assert {c["outcome"] for c in on_cases.values()} >= {"passed", "failed"}
    assert any(c["causes"] for c in on_cases.values())  # failures with a named cause, compared bit for bit
    differ = {i: (on_cases[i], off_cases[i]) for i in on_cases if on_cases[i] != off_cases[i]}
    assert not differ, differ


def test_only_the_measured_run_says_which_code_ran(both):
    on = {h["name"]: h["hook_code"] for h in both["on"][1]["hooks"] if h.get("counts")}
    off = {h["name"]: h["hook_code"] for h in both["off"][1]["hooks"] if h.get("counts")}
    assert all(code["measured"] for code in on.values()), {n: c["reason"] for n, c in on.items() if not c["measured"]}
    assert all(not code["measured"] and code["reason"] == "not measured: --hook-coverage off" for code in off.values())
    assert "hook code: n/a (not measured: --hook-coverage off)" in both["off"][0].output
