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

import ast
import dataclasses
import functools
import json
import linecache
import os
import sys
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = ["Branch", "HookCode", "HookCodeLedger", "hook_code_from_json", "hook_code_of", "summarize"]

#: The calls whose function argument is a future's callback (run where the future completes).
_CALLBACK_METHODS = ("then", "add_done_callback")
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
    """

    measured: bool
    reason: Optional[str] = None
    files: Dict[str, Tuple[int, int, int, int]] = dataclasses.field(default_factory=dict)
    never_taken: Tuple[Branch, ...] = ()
    not_measured: Tuple[Tuple[str, str], ...] = ()
    definitions: Tuple[str, ...] = ()
    cases: int = 0

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
                "definitions": list(self.definitions)}


def hook_code_from_json(data: Dict[str, Any]) -> HookCode:
    """A :class:`HookCode` from its JSON (``hooks[].hook_code``)."""
    return HookCode(bool(data.get("measured")), data.get("reason"),
                    {f["file"]: (f["lines_run"], f["lines"], f["branches_taken"], f["branches"])
                     for f in data.get("files", ())},
                    tuple(Branch(b["file"], b["line"], b.get("to"), b.get("source", ""), b.get("how", ""))
                          for b in data.get("never_taken", ())),
                    tuple((m["where"], m["what"]) for m in data.get("not_measured", ())),
                    tuple(data.get("definitions", ())), int(data.get("cases", 0)))


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


def display_path(path: str) -> str:
    """``path`` as a report names it: relative to the working directory where it lies under it, else to the
    longest ``sys.path`` entry it lies under (``torch/distributed/...``), else as it is."""
    path = os.path.realpath(path)
    bases = [os.getcwd()] + sorted((os.path.realpath(p) for p in sys.path if p), key=len, reverse=True)
    for base in bases:
        if path.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, base)
    return path


@dataclasses.dataclass(frozen=True)
class _Def:
    qualname: str
    start: int
    end: int
    body: int  # the first line of its body
    node: Any
    unit: bool  # a module-level function or a method: what "a function of the hook's that ran" means


@functools.lru_cache(maxsize=64)
def _definitions(path: str) -> Tuple[_Def, ...]:
    """Every function and class of the file, with its qualified name and lines (decorators included)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ()
    out: List[_Def] = []

    def visit(node: Any, prefix: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                is_function = not isinstance(child, ast.ClassDef)
                out.append(_Def(name, start, child.end_lineno or child.lineno,
                                child.body[0].lineno if child.body else child.lineno, child,
                                unit=is_function and not in_function))
                visit(child, f"{name}.<locals>." if is_function else f"{name}.", in_function or is_function)
            else:
                visit(child, prefix, in_function)

    visit(tree, "", False)
    return tuple(out)


def _code_lines(defs: Sequence[_Def], regions: Sequence[_Def]) -> Set[int]:
    """The lines of ``regions`` that run when the hook runs: the bodies of its functions, not the ``def`` and
    ``class`` statements and class-level code, which run when the module is imported."""
    out: Set[int] = set()
    for region in regions:
        functions = [region] if not isinstance(region.node, ast.ClassDef) else [
            d for d in defs if region.start <= d.start and d.end <= region.end and
            not isinstance(d.node, ast.ClassDef)]
        for d in functions:
            out.update(range(d.body, d.end + 1))
    return out


def _callbacks(path: str, regions: Sequence[_Def]) -> List[_Def]:
    """The functions defined inside ``regions`` and passed by name to ``Future.then`` / ``add_done_callback``."""
    out = []
    defs = _definitions(path)
    for region in regions:
        names = set()
        for node in ast.walk(region.node):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _CALLBACK_METHODS:
                names.update(a.id for a in node.args if isinstance(a, ast.Name))
        for d in defs:
            if d.node is not region.node and region.start <= d.start and d.end <= region.end and \
                    d.qualname.rsplit(".", 1)[-1] in names and not isinstance(d.node, ast.ClassDef):
                out.append(d)
    return out


def _how(path: str, line: int, to: int) -> str:
    for node in _statements_at(path, line):
        if isinstance(node, (ast.If, ast.While)) and node.body:
            if to == node.body[0].lineno:
                return "never true"
            return "never false"
        if isinstance(node, (ast.For, ast.AsyncFor)) and node.body:
            return "never ran its body" if to == node.body[0].lineno else "never finished the loop"
    return f"never to line {to}" if to > 0 else "never leaves the function from here"


@functools.lru_cache(maxsize=256)
def _statements_at(path: str, line: int) -> Tuple[Any, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == line)


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
        defs = _definitions(path)
        mine = {q for p, q in roots if p == path}
        regions = [d for d in defs if d.qualname in mine or (d.unit and any(d.start <= n <= d.end for n in executed))]
        regions = [d for d in regions if not any(o is not d and o.start <= d.start and d.end <= o.end for o in regions)]
        if not regions:
            continue
        lines = _code_lines(defs, regions)
        name = display_path(path)
        if on_gloo:
            for cb in _callbacks(path, regions):
                lines -= set(range(cb.body, cb.end + 1))
                not_measured.append((f"{name}:{cb.start}", f"{cb.qualname} (a future's callback: gloo runs it on "
                                                          "its own thread)"))
        statements = (set(file_report.get("executed_lines", ())) | set(file_report.get("missing_lines", ()))) & lines
        run = set(file_report.get("executed_lines", ())) & lines
        taken = [tuple(b) for b in file_report.get("executed_branches", ()) if b[0] in lines]
        missing = [tuple(b) for b in file_report.get("missing_branches", ()) if b[0] in lines]
        files[name] = (len(run), len(statements), len(taken), len(taken) + len(missing))
        for a, b in sorted(missing):
            how = _how(path, a, b) if a in run else "the line never ran"
            never.append(Branch(name, a, b if b > 0 else None, linecache.getline(path, a).strip(), how))
    definitions = tuple(f"{display_path(p)}:{q}" for p, q in roots)
    return HookCode(True, None, files, tuple(never), tuple(not_measured), definitions, ledger.cases.get(hook, 0))


def hook_code_of(state: Any, hook: str) -> Optional[HookCode]:
    """The session's :class:`HookCode` of ``hook`` (``state``: the controller's session state, whose runner holds
    the ledger), or ``None`` where no case of it ran here."""
    ledger = getattr(getattr(state, "runner", None), "hook_code", None)
    if ledger is None:
        return None
    enabled = getattr(getattr(state, "settings", None), "hook_coverage", True)
    if enabled and not ledger.cases.get(hook):
        return None
    return ledger.summary(hook, enabled)
