"""The suite's source digest (``suite.source_digest``), and when the outcomes guard reads the default run
``make conform`` wrote instead of running it again (``tests/default_run_reuse.py``)."""

from __future__ import annotations

import copy
import json
import os
import sys
import xml.etree.ElementTree as ET

import pytest

from conformance.reports.results import build_document, schema_problems
from conformance.reports.source_digest import source_digest, source_files
from tests.default_run_reuse import default_run_problem, reused_default_run

DIGEST = "0123456789abcdef"
SUITE = "/repo/conformance/suite"


def _doc(**changes):
    """A results document of a default run as ``make conform`` writes it."""
    doc = {
        "suite": {"name": "commhook-conformance", "version": "0.1.0", "source_digest": DIGEST},
        "run": {"complete": True, "interrupted": False, "exit_status": 0, "finished_at": "2026-11-27T17:00:00+00:00",
                "counts": {"passed": 2, "xfailed": 1, "deselected": 11},
                "args": ["-c", f"{SUITE}/pytest.ini", "--rootdir", SUITE, "-p", "conformance.controller.pytest_plugin",
                         "-v", "--junitxml=reports/conformance.xml", "--json=reports/conformance.json",
                         "--markdown=reports/conformance.md", SUITE]},
        "environment": {"torch_version": "2.13.0+cpu", "python_version": "3.11.7", "depth": "default",
                        "hypothesis_examples": 3, "with_compiled_ddp": False, "world_sizes": [2, 3, 4],
                        "backend": "gloo", "device": "cpu", "cpu_pools": [],
                        "known_failures_files": ["/repo/fixtures/known_failures.toml"]},
        "cases": [{"name": "test_parity[a-ws2]"}, {"name": "test_parity[a-ws3]"}, {"name": "test_parity[b-ws2]"}],
    }
    for path, value in changes.items():
        where, key = path.split(".")
        doc[where][key] = value
    return doc


def _problem(doc):
    return default_run_problem(doc, DIGEST, "2.13.0+cpu", "3.11.7")


def test_make_conform_s_default_run_stands_for_the_default_run():
    assert _problem(_doc()) is None


@pytest.mark.parametrize("changes, why", [
    ({"suite.source_digest": "fedcba9876543210"}, "other suite files"),
    ({"suite.source_digest": None}, "other suite files"),
    ({"run.exit_status": 1}, "exit status 0"),
    ({"run.complete": False}, "complete run"),
    ({"run.interrupted": True}, "complete run"),
    ({"run.counts": None}, "no counts"),
    ({"run.args": _doc()["run"]["args"] + ["-k", "parity"]}, "given -k parity"),
    ({"run.args": _doc()["run"]["args"] + ["--hook", "my_hooks:SPEC"]}, "given --hook my_hooks:SPEC"),
    ({"run.args": _doc()["run"]["args"] + ["-p", "my_plugin"]}, "given -p my_plugin"),
    ({"environment.torch_version": "2.11.0+cu130"}, "torch 2.11.0+cu130"),
    ({"environment.python_version": "3.12.1"}, "Python 3.12.1"),
    ({"environment.depth": "nightly"}, "depth"),
    ({"environment.hypothesis_examples": 200}, "hypothesis_examples"),
    ({"environment.world_sizes": [2]}, "world_sizes"),
    ({"environment.device": "cuda"}, "device"),
    ({"environment.known_failures_files": ["/repo/fixtures/known_failures.toml", "/mine.toml"]},
     "known_failures_files"),
])
def test_anything_but_this_suite_s_complete_default_run_here_is_run_again(changes, why):
    problem = _problem(_doc(**changes))
    assert problem is not None and why in problem, problem


def _write_reports(tmp_path, doc, junit_names):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "conformance.json").write_text(json.dumps(doc))
    suite = ET.Element("testsuites")
    cases = ET.SubElement(suite, "testsuite")
    for name in junit_names:
        ET.SubElement(cases, "testcase", name=name)
    ET.ElementTree(suite).write(reports / "conformance.xml")
    return str(reports)


def test_the_reused_run_is_the_junit_s_cases_and_the_json_s_counts(tmp_path):
    doc = _doc()
    reports = _write_reports(tmp_path, doc, [c["name"] for c in doc["cases"]])
    run, note = reused_default_run(DIGEST, "2.13.0+cpu", reports, "3.11.7")
    assert run is not None, note
    assert sorted(c.name for c in run.cases) == sorted(c["name"] for c in doc["cases"])
    assert run.closing_counts() == {"passed": 2, "xfailed": 1, "deselected": 11}
    assert run.returncode == 0 and "reused" in run.output and DIGEST in run.output


def test_a_junit_that_is_not_the_json_s_run_is_not_reused(tmp_path):
    doc = _doc()
    reports = _write_reports(tmp_path, doc, ["test_parity[a-ws2]"])
    run, note = reused_default_run(DIGEST, "2.13.0+cpu", reports, "3.11.7")
    assert run is None and "does not hold the cases" in note


def test_no_results_file_is_a_run_of_its_own(tmp_path):
    run, note = reused_default_run(DIGEST, "2.13.0+cpu", str(tmp_path / "reports"), "3.11.7")
    assert run is None and "no results file" in note


@pytest.fixture
def fake_suite(tmp_path, monkeypatch):
    """A package ``fk`` with a nested package ``fk.models`` (a regular install's layout) and a cache folder."""
    root = tmp_path / "site"
    (root / "fk" / "models").mkdir(parents=True)
    (root / "fk" / "__pycache__").mkdir()
    for rel, text in {"fk/__init__.py": "", "fk/x.py": "A = 1\n", "fk/table.toml": "[a]\n", "fk/notes.txt": "n",
                      "fk/__pycache__/x.cpython-311.pyc": "bytes", "fk/models/__init__.py": "",
                      "fk/models/m.py": "M = 1\n"}.items():
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    for name in ("fk", "fk.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return root


def test_each_file_counts_once_under_its_own_package(fake_suite):
    keys = [key for key, _ in source_files(("fk", "fk.models"))]
    assert sorted(keys) == ["fk.models/__init__.py", "fk.models/m.py", "fk/__init__.py", "fk/table.toml", "fk/x.py"]


def test_the_digest_changes_with_any_counted_file_and_only_then(fake_suite):
    packages = ("fk", "fk.models")
    before = source_digest(packages)
    assert source_digest(packages) == before
    (fake_suite / "fk" / "notes.txt").write_text("other")  # not a counted suffix
    (fake_suite / "fk" / "__pycache__" / "y.py").write_text("cache")
    assert source_digest(packages) == before
    (fake_suite / "fk" / "models" / "m.py").write_text("M = 2\n")
    edited = source_digest(packages)
    assert edited != before
    os.rename(fake_suite / "fk" / "x.py", fake_suite / "fk" / "y.py")
    assert source_digest(packages) not in (before, edited)


def test_the_results_document_carries_the_digest_and_the_counts_its_schema_allows():
    digest = source_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    run = {"started_at": "2026-11-27T17:00:00+00:00", "finished_at": "2026-11-27T17:01:00+00:00", "duration_s": 60.0,
           "exit_status": 0, "interrupted": False, "complete": True, "fail_on": "failures", "args": [],
           "counts": {"passed": 2, "deselected": 11}}
    env = {"torch_version": "2.13.0+cpu", "torch_build": "cpu", "backend": "gloo", "device": "cpu", "world_sizes": [2]}
    doc = build_document(suite_version="0.1.0", run=run, environment=env, hooks=[], cases=[], source_digest=digest)
    assert doc["suite"]["source_digest"] == digest and schema_problems(doc) == []
    assert "source_digest" not in build_document(suite_version="0.1.0", run=run, environment=env, hooks=[],
                                                 cases=[])["suite"]
    bad = copy.deepcopy(doc)
    bad["run"]["counts"] = {"passed": -1, "retried": 1}
    assert schema_problems(bad)
