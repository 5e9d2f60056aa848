"""Running the conformance suite as a user would, and reading its JUnit XML.

The meta-tests drive ``python -m conformance`` in a subprocess (the same code
path as ``conform``) and judge the suite by its machine-readable report.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Dict, List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class CaseReport:
    name: str
    outcome: str  # passed | failed | skipped | xfailed | error
    properties: Dict[str, str]
    message: str

    @property
    def hook(self) -> str:
        return self.properties.get("hook", "")

    @property
    def check(self) -> str:
        return self.properties.get("check", "")


@dataclasses.dataclass
class SuiteRun:
    returncode: int
    output: str
    cases: List[CaseReport]

    def by_hook(self) -> Dict[str, List[CaseReport]]:
        out: Dict[str, List[CaseReport]] = defaultdict(list)
        for case in self.cases:
            out[case.hook].append(case)
        return out


def run_suite(args: Sequence[str], junit_path: str, *, timeout: float = 900, cwd: str = REPO,
              pythonpath: Sequence[str] = ()) -> SuiteRun:
    """``python -m conformance ARGS --junitxml JUNIT``, from ``cwd`` (default: the repository root).

    From the repository root, the repository is put on ``PYTHONPATH`` (for
    ``tests.zoo``); from anywhere else the run sees only what a user's shell
    would: the installed package, the working directory and ``pythonpath``
    (which leads ``PYTHONPATH`` in both cases).
    """
    env = dict(os.environ)
    if cwd == REPO:
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    else:
        env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", *args, f"--junitxml={junit_path}", "-p", "no:randomly"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    cases = read_junit(junit_path) if os.path.exists(junit_path) else []
    return SuiteRun(proc.returncode, proc.stdout, cases)


def failures_section(output: str) -> str:
    """The ``FAILURES`` section of pytest's terminal output: the text printed for each failed case."""
    match = re.search(r"^=+ FAILURES =+$(.*?)^=+ [^=\n]+ =+$", output, re.MULTILINE | re.DOTALL)
    assert match, f"no FAILURES section in:\n{output[-3000:]}"
    return match.group(1)


def read_junit(path: str) -> List[CaseReport]:
    out = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                message = (el.get("message") or "") + "\n" + (el.text or "")
                if tag == "skipped":
                    outcome = "xfailed" if el.get("type") == "pytest.xfail" else "skipped"
                else:
                    outcome = "failed" if tag == "failure" else "error"
                break
        out.append(CaseReport(tc.get("name"), outcome, props, message))
    return out


#: The block every failure ends with: the heading line, then the command indented by two
#: spaces, which may start with a ``PYTHONPATH=...`` assignment, and runs ``conform`` or
#: ``/path/to/python -m conformance``. In pytest's long report each line may carry the "E   "
#: prefix of an exception.
_RERUN_BLOCK = re.compile(
    r"^(?:E +)?Re-run just this case:\n(?:E +)?  ((?:PYTHONPATH=(?:'[^']*'|\S+) )?"
    r"(?:conform|(?:'[^']*'|\S+) -m conformance) [^\n]*)$", re.MULTILINE)


def rerun_command(message: str) -> str:
    """The shell command of the ``Re-run just this case:`` block in a failure ``message``.

    Parses that block exactly: the line after the heading. Every copy of the
    block in the message (pytest repeats the exception text) must agree.
    """
    commands = set(_RERUN_BLOCK.findall(message))
    assert len(commands) == 1, f"expected one re-run command, found {sorted(commands)} in:\n{message[-3000:]}"
    return commands.pop()


def rerun_args(message: str) -> List[str]:
    """The arguments of ``conform`` (or ``python -m conformance``) in the re-run command of a failure
    ``message`` (an assignment such as ``PYTHONPATH=...`` before it is left out)."""
    words = shlex.split(rerun_command(message))
    if "conform" in words:
        return words[words.index("conform") + 1:]
    return words[words.index("conformance") + 1:]


# -- case plans without a run --------------------------------------------------------------


def plan_settings(world_size: int = 2, extra_world_size: int = 3, *, backend: str = "gloo", device: str = "cpu",
                  gpu_count: int = 0, cpu_pools: Sequence[int] = ()):
    """The :class:`~conformance.controller.settings.Settings` of a run, for planning its cases (nothing starts)."""
    from conformance.controller.settings import Settings

    return Settings(hooks=(), builtins=True, entry_points=False, world_size=world_size,
                    extra_world_size=extra_world_size, backend=backend, device=device, case_timeout_s=60.0,
                    hypothesis_examples=3, known_failures=(), gpu_count=gpu_count, cpu_pools=tuple(cpu_pools))


def planned_test_names(specs: Sequence, settings=None) -> List[str]:
    """``test_x[case id]`` of every case the suite plans for ``specs`` (every API), skipped ones included."""
    from conformance.apis.registry import HOOK_APIS, planned_cases

    settings = settings or plan_settings()
    return [f"{test}[{case.id}]" for api in HOOK_APIS.values() for test in api.plans
            for case in planned_cases(test, specs, settings)]
