"""The default run ``make conform`` just wrote, read back for the outcomes guard instead of run a second time.

README's two commands are ``make conform`` (the default run: PyTorch's built-in hooks, its reports in
``reports/``) and ``make test``, whose outcomes guard (``tests/test_outcomes_guard.py``) needs that same
default run. Where ``reports/conformance.json`` says it was written by this very suite (its
``suite.source_digest`` is the digest of the files imported now, :mod:`conformance.reports.source_digest`), by a
default run (no option that selects or changes cases) that ran every case to the end with exit status 0, on this
torch and this Python, and ``reports/conformance.xml`` holds the same cases, the guard reads those reports: the
run would be the same. Anything else, and the guard runs the default run itself, as before. A reused run that was
not the default one could only fail the guard (its outcomes would differ from the expectation); a run of other
suite files is never reused (the digest differs).
"""

from __future__ import annotations

import json
import os
import platform
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tests.meta_helpers import REPO, SuiteRun, read_junit

__all__ = ["DEFAULT_REPORTS", "default_run_problem", "reused_default_run"]

#: Where ``make conform`` writes its reports (the Makefile's ``REPORTS``), from the repository root.
DEFAULT_REPORTS = os.path.join(REPO, "reports")

#: pytest arguments the CLI passes for every run, with their values (``-c``, ``--rootdir``, the plugin), and the
#: options that change only what is reported or printed.
_FIXED_WITH_VALUE = ("-c", "--rootdir", "-p")
_REPORT_OPTIONS = ("--junitxml=", "--json=", "--markdown=")
_VERBOSITY = ("-q", "-v", "-vv", "-qq")

#: The environment of the default run on a machine without a GPU (README: what ``make conform`` runs).
_DEFAULT_ENVIRONMENT = {"depth": "default", "hypothesis_examples": 3, "with_compiled_ddp": False,
                        "world_sizes": [2, 3, 4], "backend": "gloo", "device": "cpu", "cpu_pools": []}


def _selection_args(args: Sequence[str]) -> List[str]:
    """What in pytest's ``args`` (``run.args``) is neither the CLI's fixed arguments, a report path, a verbosity
    flag nor the suite's own folder: the options that would select or change cases."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in _FIXED_WITH_VALUE and i + 1 < len(args) and (arg != "-p" or args[i + 1] ==
                                                             "conformance.controller.pytest_plugin"):
            skip = True
            continue
        if arg.startswith(_REPORT_OPTIONS) or arg in _VERBOSITY:
            continue
        if arg.rstrip("/").endswith(os.path.join("conformance", "suite")):
            continue
        out.append(arg)
    return out


def default_run_problem(doc: Dict[str, Any], digest: str, torch_version: str,
                        python_version: str) -> Optional[str]:
    """Why the results document ``doc`` cannot stand for the default run of this suite here, or ``None`` where it
    can: written by files of source digest ``digest``, a default run (:func:`_selection_args` empty, the default
    environment), complete, with exit status 0 and its counts, on ``torch_version`` and ``python_version``."""
    suite, run, env = doc.get("suite") or {}, doc.get("run") or {}, doc.get("environment") or {}
    if suite.get("source_digest") != digest:
        return f"written by other suite files (source digest {suite.get('source_digest')!r}, now {digest!r})"
    if not (run.get("complete") and not run.get("interrupted") and run.get("exit_status") == 0):
        return "not a complete run with exit status 0"
    if not run.get("counts"):
        return "no counts of its closing line (a results file older than schema 1.9)"
    extra = _selection_args(run.get("args") or [])
    if extra:
        return f"not the default run: it was given {' '.join(extra)}"
    if (env.get("torch_version"), env.get("python_version")) != (torch_version, python_version):
        return (f"run on torch {env.get('torch_version')} and Python {env.get('python_version')}, "
                f"not torch {torch_version} and Python {python_version}")
    changed = sorted(k for k, v in _DEFAULT_ENVIRONMENT.items() if env.get(k) != v)
    files = env.get("known_failures_files") or []
    if len(files) != 1 or not files[0].endswith(os.path.join("fixtures", "known_failures.toml")):
        changed.append("known_failures_files")
    return f"not the default run's settings: {', '.join(changed)}" if changed else None


def _junit_path(doc: Dict[str, Any], reports: str) -> str:
    for arg in (doc.get("run") or {}).get("args") or []:
        if arg.startswith("--junitxml="):
            path = arg.split("=", 1)[1]
            return path if os.path.isabs(path) else os.path.join(os.path.dirname(reports), path)
    return os.path.join(reports, "conformance.xml")


def reused_default_run(digest: str, torch_version: str, reports: str = DEFAULT_REPORTS,
                       python_version: str = platform.python_version()) -> Tuple[Optional[SuiteRun], str]:
    """``(the run, where it came from)`` read from ``reports/conformance.json`` and the JUnit XML it names, where
    :func:`default_run_problem` finds nothing and the XML holds exactly the JSON's cases; else ``(None, why
    not)``."""
    json_path = os.path.join(reports, "conformance.json")
    try:
        with open(json_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"no results file to reuse ({json_path}: {exc})"
    problem = default_run_problem(doc, digest, torch_version, python_version)
    if problem is not None:
        return None, f"{json_path}: {problem}"
    junit = _junit_path(doc, reports)
    try:
        cases = read_junit(junit)
    except (OSError, ET.ParseError) as exc:  # a missing or broken XML: run instead
        return None, f"{junit}: {exc}"
    if sorted(c.name for c in cases) != sorted(c.get("name", "") for c in doc.get("cases") or []):
        return None, f"{junit} does not hold the cases of {json_path}"
    note = (f"(the default run `make conform` wrote at {doc['run'].get('finished_at')}, reused: {json_path} and "
            f"{junit}, source digest {digest})")
    return SuiteRun(0, note, cases, counts=dict(doc["run"]["counts"])), note
