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
import threading
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

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
    #: The counts of pytest's closing line where they were read from a results file (``run.counts``); else
    #: ``None``, and :meth:`closing_counts` reads them from ``output``.
    counts: Optional[Dict[str, int]] = None

    def closing_counts(self) -> Dict[str, int]:
        """``{"passed": 382, "deselected": 11, ...}``: :attr:`counts`, or pytest's closing line in ``output``
        (``382 passed, 43 skipped, 11 deselected, 358 xfailed in 73.45s``); ``{}`` where there is neither."""
        if self.counts is not None:
            return dict(self.counts)
        closing = re.findall(r"^=* ?(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s", self.output, re.M)
        return pytest_counts(closing[-1]) if closing else {}

    def by_hook(self) -> Dict[str, List[CaseReport]]:
        out: Dict[str, List[CaseReport]] = defaultdict(list)
        for case in self.cases:
            out[case.hook].append(case)
        return out


def pytest_counts(text: str) -> Dict[str, int]:
    """``{"passed": 307, ...}`` from pytest's words: ``307 passed, 43 skipped, ...``."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", text)}


def run_suite(args: Sequence[str], junit_path: str, *, timeout: float = 900, cwd: str = REPO,
              pythonpath: Sequence[str] = (), env: Optional[Dict[str, str]] = None) -> SuiteRun:
    """``python -m conformance ARGS --junitxml JUNIT``, from ``cwd`` (default: the repository root).

    From the repository root, the repository is put on ``PYTHONPATH`` (for
    ``tests.zoo``); from anywhere else the run sees only what a user's shell
    would: the installed package, the working directory and ``pythonpath``
    (which leads ``PYTHONPATH`` in both cases). ``env``: the environment to start
    from (default: this process's, now).
    """
    env = dict(os.environ if env is None else env)
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
                  gpu_count: int = 0, cpu_pools: Sequence[int] = (), depth: str = "default"):
    """The :class:`~conformance.controller.settings.Settings` of a run, for planning its cases (nothing starts)."""
    from conformance.controller.settings import Settings

    return Settings(hooks=(), builtins=True, entry_points=False, world_size=world_size,
                    extra_world_size=extra_world_size, backend=backend, device=device, case_timeout_s=60.0,
                    hypothesis_examples=3, known_failures=(), gpu_count=gpu_count, cpu_pools=tuple(cpu_pools),
                    depth=depth)


def planned_test_names(specs: Sequence, settings=None) -> List[str]:
    """``test_x[case id]`` of every case the suite plans for ``specs`` (every API), skipped ones included."""
    from conformance.apis.registry import HOOK_APIS, planned_cases

    settings = settings or plan_settings()
    return [f"{test}[{case.id}]" for api in HOOK_APIS.values() for test in api.plans
            for case in planned_cases(test, specs, settings)]


# -- the meta-test shape: a zoo run, described as data ----------------------------------------


def select(run: SuiteRun, hook: str, outcome: str = "", **where) -> List[CaseReport]:
    """The cases of ``hook`` in ``run`` with that ``outcome`` (any, if empty) whose JUnit properties match
    ``where``: a string value must equal the property, a tuple or set value must contain it."""
    def matches(case: CaseReport) -> bool:
        for key, want in where.items():
            have = case.properties.get(key)
            if have not in want if isinstance(want, (tuple, set, frozenset)) else have != want:
                return False
        return not outcome or case.outcome == outcome

    return [c for c in run.by_hook()[hook] if matches(c)]


@dataclasses.dataclass(frozen=True)
class Catch:
    """A known-bad hook and what must fail on it: the cases whose property ``by`` (``check`` or ``config``)
    takes each value in ``values`` include a failed one; with ``only``, no other value fails."""
    hook: str
    values: frozenset
    by: str = "check"
    only: bool = False


@dataclasses.dataclass(frozen=True)
class Cause:
    """Failed cases of ``hook`` at ``check`` (narrowed by ``where``) each carry every text of ``texts``
    (a named cause, a hint); with ``no_lossy_hint``, none says ``LossyContract``."""
    hook: str
    check: object  # one check, or a tuple of them
    texts: tuple
    where: tuple = ()  # (property, value or tuple of values) pairs
    no_lossy_hint: bool = False

    def cases(self, run: SuiteRun) -> List[CaseReport]:
        checks = self.check if isinstance(self.check, tuple) else (self.check,)
        return select(run, self.hook, "failed", check=checks, **dict(self.where))


@dataclasses.dataclass(frozen=True)
class Pick:
    """One case of ``hook``: the first with that ``outcome`` (any, if empty) whose properties match ``where``."""
    hook: str
    where: tuple = ()
    outcome: str = ""

    def case(self, run: SuiteRun) -> CaseReport:
        cases = select(run, self.hook, self.outcome, **dict(self.where))
        assert cases, f"no case of {self.hook} with {dict(self.where)} ({self.outcome or 'any outcome'})"
        return cases[0]


#: Threads that run the session's zoo runs and background jobs beside the tests in line.
BACKGROUND_THREADS = 2


@dataclasses.dataclass(frozen=True, eq=False)
class BackgroundJob:
    """Work a test module reads, done once per session in the zoo runs' background threads
    (:class:`ZooRuns`), so it overlaps the other tests instead of running in line: ``work(runs, directory,
    env)`` returns what ``zoo_runs(job)`` gives (``runs``: the session's :class:`ZooRuns`, whose zoo runs it
    may read; ``directory``: a fresh directory of its own; ``env``: the environment to run processes in, as it
    was when the session's tests were collected, never what a test running meanwhile set). A module names its
    jobs at module level, as it names its :class:`MetaZoo` s, so ``tests/conftest.py`` prefetches them."""

    name: str
    work: Callable[["ZooRuns", str, Dict[str, str]], object]


@dataclasses.dataclass(frozen=True)
class MetaZoo:
    """One meta-run: the suite over a zoo (``args`` to ``python -m conformance``), and what its JUnit must show.

    ``bad``: the zoo's known-bad spec names; ``documented``: the names its ``EXPECTED_CATCH`` (or
    ``LOSSY_EXPECTED``) explains; ``catches``: what must catch each, and ``caught_elsewhere``: bad specs
    caught only where this run cannot (another backend), tested by their own test. ``good``: the known-good
    specs; ``good_coverage(spec)``: (property, the values that must pass, whether exactly those);
    ``good_outcomes``: the outcomes a good spec's case may have (a skip with its reason, where planned).
    ``acting``: a failure that must name everything needed to act on it, with ``acting_needles``;
    ``rerun``: a failed case whose re-run command must reproduce exactly it. ``causes``: failures and the
    texts they must carry (named cause, no lossy hint where one explains, the hint where none does).
    """
    name: str
    args: tuple
    bad: frozenset
    documented: frozenset
    catches: tuple
    good: tuple
    good_coverage: object = None  # Callable[[HookSpec], Tuple[str, set, bool]] or None: cases only
    good_outcomes: frozenset = frozenset({"passed"})
    caught_elsewhere: frozenset = frozenset()
    acting: object = None  # Pick or None
    acting_needles: tuple = ()
    rerun: object = None  # Pick or None
    causes: tuple = ()


class ZooRuns:
    """Each :class:`MetaZoo` run, and each :class:`BackgroundJob`, done once per pytest session and shared by
    every test that needs it.

    :meth:`prefetch` starts the runs the session's tests will need at once, in :data:`BACKGROUND_THREADS`
    background threads (the zoo runs first, then the jobs, dealt out in turn), in the environment of that
    moment (a test that later changes ``os.environ`` does not reach them): the tests in line keep part of a
    2-core machine busy, and these fill the rest. Whoever needs a run first runs it (a test, or a job that
    reads it before its turn); everyone else waits for it, so nothing runs twice and nothing waits on itself.
    """

    def __init__(self, tmp_dir: Callable[[str], str]):
        self._tmp_dir = tmp_dir
        self._runs: Dict[str, Any] = {}
        self._errors: Dict[str, BaseException] = {}
        self._done: Dict[str, threading.Event] = {}
        self._dirs: Dict[str, str] = {}
        self._lock = threading.Lock()
        self._env: Optional[Dict[str, str]] = None

    def _junit(self, zoo: Any) -> str:
        with self._lock:
            if zoo.name not in self._dirs:  # one directory per zoo: the run's JUnit XML and its reproducers
                self._dirs[zoo.name] = self._tmp_dir(zoo.name)
            return os.path.join(self._dirs[zoo.name], f"{zoo.name}.xml")

    def directory(self, zoo: Any) -> str:
        """The directory of ``zoo``'s run: its JUnit XML, and what a job writes beside it."""
        return os.path.dirname(self._junit(zoo))

    def reproducers(self, zoo: MetaZoo) -> str:
        """The directory where ``zoo``'s run wrote a standalone reproducer per failed case
        (``--write-reproducers``; ``tests/test_reproducers.py`` runs some)."""
        return os.path.join(self.directory(zoo), "reproducers")

    def _run(self, zoo: Any, env: Optional[Dict[str, str]]) -> None:
        try:
            junit = self._junit(zoo)  # inside: a directory that cannot be made is the error every reader sees
            if isinstance(zoo, BackgroundJob):
                self._runs[zoo.name] = zoo.work(self, os.path.dirname(junit), dict(os.environ if env is None else env))
                return
            args = [*zoo.args, "--write-reproducers", self.reproducers(zoo)]
            self._runs[zoo.name] = run_suite(args, junit, env=env)  # kept even if it failed
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test that needs the run
            self._errors[zoo.name] = exc

    def _ensure(self, zoo: Any) -> None:
        """Run ``zoo`` here if nobody has started it, else wait until whoever did has finished it."""
        with self._lock:
            mine = zoo.name not in self._done
            done = self._done.setdefault(zoo.name, threading.Event())
        if mine:
            try:
                self._run(zoo, self._env)
            finally:
                done.set()
        else:
            done.wait()

    def prefetch(self, zoos: Iterable[Any]) -> None:
        todo = [z for z in dict.fromkeys(zoos) if z.name not in self._done]
        if not todo:
            return
        self._env = dict(os.environ)
        ordered = [z for z in todo if isinstance(z, MetaZoo)] + [z for z in todo if not isinstance(z, MetaZoo)]
        for k in range(BACKGROUND_THREADS):
            queue = ordered[k::BACKGROUND_THREADS]

            def work(queue: List[Any] = queue) -> None:
                for zoo in queue:
                    self._ensure(zoo)

            threading.Thread(target=work, name=f"zoo-runs-{k}", daemon=True).start()

    def __call__(self, zoo: Any) -> Any:
        self._ensure(zoo)
        if zoo.name in self._errors:
            raise self._errors[zoo.name]
        run = self._runs[zoo.name]
        if isinstance(zoo, MetaZoo):
            assert run.cases, f"the suite wrote no JUnit cases; output:\n{run.output[-4000:]}"
        return run
