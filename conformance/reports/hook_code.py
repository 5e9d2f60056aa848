"""Which of a hook's own code its cases ran: the ranks' coverage data merged per hook, and what it says.

Each rank measures, per case, the arcs of the hook's own Python code that ran (coverage.py's branch coverage,
traced only while the hook's code runs: :mod:`conformance.ranks.hook_code`) and the hook's own definitions (its
function or class, its state factory, the class of its comm object). :class:`HookCodeLedger` merges every rank's
data of every case a hook ran; :func:`summarize` turns a hook's merged data into a :class:`HookCode`: over the
hook's own definitions and every other function of its traced files that ran, the lines run of all, the branches
taken of all (coverage.py's static analysis of each file, its public JSON report), and each branch never taken
with its file, line and source text. The verdict prints it (``hook code: 14 of 16 branches taken; never taken:
my_hooks.py:88``), the JSON gives it (``hooks[].hook_code``, docs/results.md), and ``--fail-on uncovered`` and
the baseline read its never-taken branches.

A future's callback that gloo runs on one of its own threads is out of the tracer's reach (``sys.settrace`` is
per thread); a callback (a function the hook passes to ``Future.then`` or ``add_done_callback``) is therefore
not counted on gloo, and named as not measured. On NCCL the callbacks run on the thread that calls the hook.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import os
import tempfile
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from conformance.reports.code_regions import branch_words, callbacks, code_lines, definitions, display_path

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.pytest_plugin import SessionState

__all__ = ["Branch", "HookCode", "HookCodeLedger", "hook_code_from_json", "hook_code_of", "summarize"]

#: Never-taken branch lines the verdict line names; the hook's block lists them all.
VERDICT_LINES = 3


@dataclasses.dataclass(frozen=True)
class Branch:
    """A branch of the hook's code: from ``line`` of ``file`` to ``to`` (a line, or ``None``: out of the
    function), and the source text of ``line`` (stripped); ``how``: ``"never true"``, ``"never false"`` or
    ``"never to line N"`` / ``"never leaves the function"``."""

    file: str
    line: int
    to: Optional[int]
    source: str
    how: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def to_json(self) -> Dict[str, Any]:
        return {"file": self.file, "line": self.line, "to": self.to, "source": self.source, "how": self.how}


@dataclasses.dataclass(frozen=True)
class HookCode:
    """What of a hook's own code its cases ran.

    Attributes:
        measured: whether anything was measured; ``False`` with :attr:`reason` for a hook that is not Python (a
            C++ built-in, a compiled extension), for a run with ``--hook-coverage off``, or where coverage.py
            could not trace.
        reason: why nothing was measured, or ``None``.
        files: per file (its display path): ``(lines run, lines, branches taken, branches)``.
        never_taken: the branches never taken, by file and line.
        not_measured: ``(file:line, what)`` of code that cannot be measured here (a future's callbacks on gloo).
        definitions: the hook's own definitions, ``file:qualname``.
        cases: the cases whose ranks sent data.
        taken_by_combined: ``file:line`` of each branch line first taken by a combined case (one where two of the
            hook's switches held at once, :mod:`conformance.apis.switches`).
    """

    measured: bool
    reason: Optional[str] = None
    files: Dict[str, Tuple[int, int, int, int]] = dataclasses.field(default_factory=dict)
    never_taken: Tuple[Branch, ...] = ()
    not_measured: Tuple[Tuple[str, str], ...] = ()
    definitions: Tuple[str, ...] = ()
    cases: int = 0
    taken_by_combined: Tuple[str, ...] = ()

    @property
    def lines(self) -> Tuple[int, int]:
        return sum(f[0] for f in self.files.values()), sum(f[1] for f in self.files.values())

    @property
    def branches(self) -> Tuple[int, int]:
        return sum(f[2] for f in self.files.values()), sum(f[3] for f in self.files.values())

    def never_taken_lines(self) -> List[str]:
        """``file:line`` of each line with a never-taken branch, in order."""
        return list(dict.fromkeys(b.where for b in self.never_taken))

    def _short(self, places: List[str]) -> List[str]:
        """``file:line`` with each file by its base name where no other file of the hook's has it."""
        names = [f.rsplit("/", 1)[-1] for f in self.files]
        return [p if names.count(p.rsplit(":", 1)[0].rsplit("/", 1)[-1]) != 1 else p.rsplit("/", 1)[-1]
                for p in places]

    @property
    def text(self) -> str:
        """``hook code: 14 of 16 branches taken; never taken: my_hooks.py:88, my_hooks.py:121``, or the reason it
        is ``n/a``."""
        if not self.measured:
            return f"hook code: n/a ({self.reason})"
        taken, total = self.branches
        run, lines = self.lines
        head = (f"hook code: {taken} of {total} branch{'es' if total != 1 else ''} taken" if total else
                f"hook code: {run} of {lines} line{'s' if lines != 1 else ''} run, no branch")
        where = self._short(self.never_taken_lines())
        if where:
            shown = ", ".join(where[:VERDICT_LINES]) + (f" and {len(where) - VERDICT_LINES} more"
                                                        if len(where) > VERDICT_LINES else "")
            head += f"; never taken: {shown}"
        if self.not_measured:
            head += f"; {len(self.not_measured)} future callback(s) not measured on gloo"
        if self.taken_by_combined:
            shown = self._short(list(self.taken_by_combined))
            head += f"; first taken by the combined cases: {', '.join(shown)}"
        return head

    def detail_lines(self) -> List[str]:
        """One line per never-taken branch with its source (``my_hooks.py:88  if n >= 2**19:  (never true)``), then
        what could not be measured."""
        by_line: Dict[str, List[Branch]] = {}
        for b in self.never_taken:
            by_line.setdefault(b.where, []).append(b)
        out = [f"never taken: {where}  {bs[0].source}  ({'; '.join(dict.fromkeys(b.how for b in bs))})"
               for where, bs in by_line.items()]
        out += [f"not measured: {where} {what}" for where, what in self.not_measured]
        return out

    def to_json(self) -> Dict[str, Any]:
        taken, total = self.branches
        run, lines = self.lines
        return {"measured": self.measured, "reason": self.reason, "cases": self.cases,
                "lines_run": run, "lines": lines, "branches_taken": taken, "branches": total,
                "files": [{"file": name, "lines_run": f[0], "lines": f[1], "branches_taken": f[2], "branches": f[3]}
                          for name, f in self.files.items()],
                "never_taken": [b.to_json() for b in self.never_taken],
                "not_measured": [{"where": where, "what": what} for where, what in self.not_measured],
                "definitions": list(self.definitions), "taken_by_combined": list(self.taken_by_combined)}


def hook_code_from_json(data: Dict[str, Any]) -> HookCode:
    """A :class:`HookCode` from its JSON (``hooks[].hook_code``)."""
    return HookCode(bool(data.get("measured")), data.get("reason"),
                    {f["file"]: (f["lines_run"], f["lines"], f["branches_taken"], f["branches"])
                     for f in data.get("files", ())},
                    tuple(Branch(b["file"], b["line"], b.get("to"), b.get("source", ""), b.get("how", ""))
                          for b in data.get("never_taken", ())),
                    tuple((m["where"], m["what"]) for m in data.get("not_measured", ())),
                    tuple(data.get("definitions", ())), int(data.get("cases", 0)),
                    tuple(data.get("taken_by_combined", ())))


class HookCodeLedger:
    """Every rank's hook-code data of every case, merged per hook (controller side).

    Attributes:
        arcs: hook -> file -> the arcs that ran (coverage.py's ``(from line, to line)``).
        roots: hook -> the hook's own definitions, ``(file, qualname)``.
        problems: hook -> why something could not be measured.
        cases: hook -> cases whose ranks sent data.
        backends: hook -> the backends its cases ran on.
    """

    def __init__(self) -> None:
        self.arcs: Dict[str, Dict[str, Set[Tuple[int, int]]]] = {}
        self.roots: Dict[str, Set[Tuple[str, str]]] = {}
        self.problems: Dict[str, Set[str]] = {}
        self.cases: Dict[str, int] = {}
        self.backends: Dict[str, Set[str]] = {}
        self._summaries: Dict[Tuple[str, bool], HookCode] = {}
        #: hook -> its never-taken branches when its first combined case started.
        self.before_combined: Dict[str, Set[Tuple[str, int, Optional[int]]]] = {}

    def combined_case_skip(self, hook: str, named: bool, enabled: bool = True) -> Optional[str]:
        """Why a combined case of ``hook`` (:mod:`conformance.apis.switches`) does not run, or ``None``: a spec that
        names its switches (``named``) always runs its own; the nightly's own combination runs where the hook's
        code, as measured over its cases so far (they run first), still has a branch never taken or code not
        measured, or where none of its other cases ran (``-k``): nothing then shows it is not needed."""
        if named or (enabled and not self.cases.get(hook)):
            return None
        code = self.summary(hook, enabled)
        if not code.measured:
            return (f"no combined case: none of the hook's code could be measured ({code.reason}), so nothing shows "
                    "one is needed; name its switches (HookSpec(switches=Switches(...))) to run one")
        if not code.never_taken and not code.not_measured:
            taken, total = code.branches
            return f"not needed: every branch of the hook's own code ran in its other cases ({taken} of {total} taken)"
        return None

    def combined_started(self, hook: str) -> None:
        """A combined case of ``hook`` is about to run: keep which branches were never taken before it (once)."""
        if hook not in self.before_combined:
            self.before_combined[hook] = {(b.file, b.line, b.to) for b in self.summary(hook).never_taken}

    def summary(self, hook: str, enabled: bool = True) -> HookCode:
        """``hook``'s :class:`HookCode` over what the ledger holds now (:func:`summarize`, kept until more comes)."""
        key = (hook, enabled)
        if key not in self._summaries:
            self._summaries[key] = summarize(self, hook, enabled)
        return self._summaries[key]

    def add(self, hook: str, outcomes: Iterable[Any], backend: str) -> None:
        """Merge the ``hook_code`` of each rank's outcome of one case of ``hook`` (run on ``backend``)."""
        data = [o.hook_code for o in outcomes if getattr(o, "hook_code", None)]
        if not data:
            return
        self._summaries.clear()
        self.cases[hook] = self.cases.get(hook, 0) + 1
        self.backends.setdefault(hook, set()).add(backend)
        arcs = self.arcs.setdefault(hook, {})
        for rank in data:
            for path, pairs in (rank.get("arcs") or {}).items():
                arcs.setdefault(path, set()).update((int(a), int(b)) for a, b in pairs)
            self.roots.setdefault(hook, set()).update((str(p), str(q)) for p, q in rank.get("roots") or ())
            if rank.get("problem"):
                self.problems.setdefault(hook, set()).add(str(rank["problem"]))

    def snapshot(self, hook: str) -> Dict[str, Set[Tuple[int, int]]]:
        """A copy of ``hook``'s arcs so far (to tell later what a case added)."""
        return {path: set(arcs) for path, arcs in self.arcs.get(hook, {}).items()}


def _report(arcs: Dict[str, Set[Tuple[int, int]]], files: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """coverage.py's JSON report of ``files`` over ``arcs``, keyed by real path."""
    import coverage

    cov = coverage.Coverage(data_file=None, branch=True, config_file=False)
    cov.set_option("run:disable_warnings", ["no-data-collected", "couldnt-parse"])
    data = cov.get_data()
    data.add_arcs({path: sorted(pairs) for path, pairs in arcs.items() if pairs})
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hook_code.json")
        try:
            cov.json_report(morfs=list(files), outfile=out, ignore_errors=True)
        except coverage.exceptions.NoDataError:
            return {}
        with open(out, encoding="utf-8") as f:
            report = json.load(f)
    return {os.path.realpath(os.path.abspath(key)): value for key, value in report.get("files", {}).items()}


def summarize(ledger: HookCodeLedger, hook: str, enabled: bool = True) -> HookCode:
    """``hook``'s :class:`HookCode` from what its ranks sent (``enabled=False``: ``--hook-coverage off``)."""
    if not enabled:
        return HookCode(False, "not measured: --hook-coverage off")
    problems = sorted(ledger.problems.get(hook, ()))
    roots = sorted(ledger.roots.get(hook, ()))
    arcs = ledger.arcs.get(hook, {})
    if not roots:
        return HookCode(False, problems[0] if problems else "no Python code of the hook ran in a case",
                        cases=ledger.cases.get(hook, 0))
    try:
        report = _report(arcs, sorted({p for p, _ in roots} | set(arcs)))
    except ImportError:
        return HookCode(False, "coverage.py is not installed here (pip install 'coverage>=7')")
    on_gloo = "gloo" in ledger.backends.get(hook, ())
    files: Dict[str, Tuple[int, int, int, int]] = {}
    never: List[Branch] = []
    not_measured: List[Tuple[str, str]] = []
    for path in sorted({p for p, _ in roots} | set(arcs)):
        file_report = report.get(os.path.realpath(path))
        if file_report is None:
            continue
        executed = {a for pair in arcs.get(path, ()) for a in pair if a > 0}
        defs = definitions(path)
        mine = {q for p, q in roots if p == path}
        regions = [d for d in defs if d.qualname in mine or (d.unit and any(d.start <= n <= d.end for n in executed))]
        regions = [d for d in regions if not any(o is not d and o.start <= d.start and d.end <= o.end for o in regions)]
        if not regions:
            continue
        lines = code_lines(defs, regions)
        name = display_path(path)
        if on_gloo:
            for cb in callbacks(path, regions):
                lines -= set(range(cb.body, cb.end + 1))
                not_measured.append((f"{name}:{cb.start}", f"{cb.qualname} (a future's callback: gloo runs it on "
                                                          "its own thread)"))
        statements = (set(file_report.get("executed_lines", ())) | set(file_report.get("missing_lines", ()))) & lines
        run = set(file_report.get("executed_lines", ())) & lines
        taken = [tuple(b) for b in file_report.get("executed_branches", ()) if b[0] in lines]
        missing = [tuple(b) for b in file_report.get("missing_branches", ()) if b[0] in lines]
        files[name] = (len(run), len(statements), len(taken), len(taken) + len(missing))
        for a, b in sorted(missing):
            how = branch_words(path, a, b) if a in run else "the line never ran"
            never.append(Branch(name, a, b if b > 0 else None, linecache.getline(path, a).strip(), how))
    own = tuple(f"{display_path(p)}:{q}" for p, q in roots)
    still = {(b.file, b.line, b.to) for b in never}
    combined = tuple(dict.fromkeys(f"{f}:{line}" for f, line, to in sorted(ledger.before_combined.get(hook, ()))
                                   if (f, line, to) not in still))
    return HookCode(True, None, files, tuple(never), tuple(not_measured), own, ledger.cases.get(hook, 0),
                    combined)


def hook_code_of(state: SessionState, hook: str) -> Optional[HookCode]:
    """The session's :class:`HookCode` of ``hook`` (``state``: the controller's session state, whose runner holds
    the ledger), or ``None`` where no case of it ran here."""
    ledger = getattr(getattr(state, "runner", None), "hook_code", None)
    if ledger is None:
        return None
    enabled = getattr(getattr(state, "settings", None), "hook_coverage", True)
    if enabled and not ledger.cases.get(hook):
        return None
    return ledger.summary(hook, enabled)
