"""A stopped run's grid (``-x``, ``--maxfail``, Ctrl-C): cases that never ran show as not run, and the pattern
claims nothing about them.

Synthetic records, no run; ``tests/test_interrupt.py`` stops a real run with ``-x``.
"""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema

from conformance.reports import results
from conformance.reports.markdown_summary import markdown_summary
from conformance.reports.matrix import NOT_RUN, HookMatrix, hook_matrix, matrix_markdown, matrix_text, not_run_records, pattern
from tests.test_results import case, document

CONFIGS = ("default", "small_buckets", "no_sync")


def stopped_after_one_failure():
    """small_buckets failed at 2 ranks, default passed there; nothing else ran."""
    out = []
    for ws in (2, 3):
        for config in CONFIGS:
            ran = ws == 2 and config != "no_sync"
            outcome = ("failed" if config == "small_buckets" else "passed") if ran else NOT_RUN
            out.append(case("h", "averaging", config, ws, outcome))
    return out


def test_cells_of_cases_that_never_ran_say_not_run():
    m = hook_matrix(stopped_after_one_failure(), "h")
    assert m.cells[("averaging", "no_sync", 2)].outcome == NOT_RUN
    lines = matrix_text(m)
    assert lines[2].split() == ["averaging", "2", "pass", "FAIL", "not", "run"]
    assert lines[3].split() == ["averaging", "3", "not", "run", "not", "run", "not", "run"]
    assert "| averaging | 3 | not run | not run | not run |" in matrix_markdown(m)


def test_the_pattern_claims_no_only_where_cases_did_not_run():
    """The issue's grid said 'fails only in strategy FULL_SHARD, only at world size 2' for cases never run."""
    text = pattern(hook_matrix(stopped_after_one_failure(), "h"))
    assert text == "fails in config small_buckets, at world size 2 (4 cases not run, which may fail too)"
    assert "only" not in text and "every" not in text and "except" not in text


def test_a_cell_where_only_some_cases_ran_counts_those_that_did_not():
    recs = [case("h", "parity", "default", 2, "failed", model="a"), case("h", "parity", "default", 2, "passed",
                                                                          model="b"),
            case("h", "parity", "default", 2, NOT_RUN, model="c")]
    cell = hook_matrix(recs, "h").cells[("parity", "default", 2)]
    assert (cell.outcome, cell.cases, cell.failed, cell.not_run) == ("fail", 3, 1, 1)
    assert cell.text() == "FAIL 1/2, 1 not run"


def test_a_finished_run_keeps_its_pattern():
    recs = [case("h", "parity", v, ws, "failed" if v == "default" else "passed") for v in CONFIGS for ws in (2, 3)]
    assert pattern(hook_matrix(recs, "h")) == "fails only in config default, at world sizes 2 and 3"


def test_not_run_records_come_from_the_collected_cases_without_a_record():
    ran = [case("h", "averaging", "NO_SHARD", 2, "passed")]
    params = SimpleNamespace(hook="h", api="ddp", variant="NO_SHARD", variant_field="config", model="net",
                             rule=None, world_size=3)
    collected = [(ran[0].id, params), ("test_ddp.py::test_averaging[h-NO_SHARD-net-ws3]", params),
                 ("test_ddp.py::test_ddp_parity[h-NO_SHARD-net-ws3]", params), ("test_ddp.py::test_x", None)]
    out = not_run_records(collected, ran)
    assert [(r.name, r.outcome, r.check, r.world_size) for r in out] == [
        ("test_averaging[h-NO_SHARD-net-ws3]", NOT_RUN, "averaging", 3),  # the check its other cases ran as
        ("test_ddp_parity[h-NO_SHARD-net-ws3]", NOT_RUN, "ddp_parity", 3)]


def test_the_grid_with_not_run_cells_validates_and_renders_again_from_json():
    recs = stopped_after_one_failure()
    ran = [r for r in recs if r.outcome != NOT_RUN]
    hooks = [{"name": "h", "api": "ddp", "reduce_dtype": "full", "lossy": None, "strategies": [], "description": "",
              "source": {"kind": "--hook", "target": "zoo:SPECS"}, "verdict": "DOES NOT CONFORM (averaging)",
              "status": "does_not_conform", "counts": {"passed": 1, "failed": 1},
              "matrix": hook_matrix(recs, "h").to_json()}]
    doc = document(ran, hooks=hooks)
    jsonschema.validate(doc, results.schema())
    again = HookMatrix.from_json("h", doc["hooks"][0]["matrix"])
    assert matrix_text(again) == matrix_text(hook_matrix(recs, "h"))
    assert "| averaging | 3 | not run | not run | not run |" in markdown_summary(doc)
