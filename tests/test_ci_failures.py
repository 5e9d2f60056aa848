"""``scripts/ci_failures.py``: what CI prints last after a red ``make conform`` (the results file's reasons)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("ci_failures_under_test", REPO / "scripts" / "ci_failures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(case_id, outcome, *, message=None, skip=None):
    return {"id": case_id, "outcome": outcome, "skip_reason": skip,
            "failure": None if message is None else {"message": message}}


def test_prints_each_failed_and_not_run_case_and_each_crash_rerun(tmp_path, capsys):
    doc = {"run": {"crash_reruns": [{"case": "test_x[h-ws2]", "hook": "h", "death": "rank 1: died",
                                      "first_run": "terminate called after throwing", "second_run": "ran to the end"}]},
           "cases": [_case("a[passed]", "passed"), _case("b[failed]", "failed", message="rank 0 raised ValueError"),
                     _case("c[skipped]", "skipped", skip="gloo has no PREMUL_SUM"),
                     _case("d[notrun]", "skipped", skip="NOT RUN: a rank died (exit code -6)"),
                     _case("e[error]", "error", message="fixture setup failed")]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    assert _module().main([str(path), "--max-chars", "100"]) == 0
    out = capsys.readouterr().out
    assert "ci: failed b[failed]\nrank 0 raised ValueError" in out
    assert "ci: skipped d[notrun]\nNOT RUN: a rank died (exit code -6)" in out
    assert "a[passed]" not in out and "c[skipped]" not in out
    assert "ci: error e[error]\nfixture setup failed" in out
    assert "a rank died in test_x[h-ws2] and the case ran once more (the second run ran to the end)" in out
    assert "terminate called after throwing" in out


def test_cuts_long_texts_and_survives_a_missing_file(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"cases": [_case("b", "failed", message="x" * 5000 + "END")]}))
    module = _module()
    assert module.main([str(path), "--max-chars", "100"]) == 0
    out = capsys.readouterr().out
    assert "characters cut" in out and out.rstrip().endswith("END") and len(out) < 400
    assert module.main([str(tmp_path / "missing.json")]) == 0
    assert "ci: no results to show" in capsys.readouterr().out
