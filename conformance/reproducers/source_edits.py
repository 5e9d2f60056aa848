"""Edits of a written reproducer's source that keep what it runs: the AST read back as text (:mod:`conformance.
reproducers.inline` inlines through them).

Each edit works on the file's text by the positions its AST gives, so the suite's code keeps its layout
and comments: :func:`cut` writes a text in place of a node; :func:`fold_case_branches` writes the case's
branch of each ``x if <CASE test> else y``; :func:`without_aliases` writes ``STEP_INPUTS`` and ``LOSS``
(the names the writer binds per case) where the loop reads them; :func:`without_empty_kwargs` leaves out
a dict bound to ``{}`` and read only as ``**name``; :func:`without_local_lambdas` writes a local lambda
where it is read (``wrap = lambda module: fully_shard(module, mesh=grid)``, what inlining FSDP2's unit
wrapping leaves); :func:`removed` leaves out what nothing reads any more; and the writer's last edit,
:func:`without_blank_lines_in_blocks`, the blank lines inside a definition.
Torch-free; raises nothing of its own.
"""

from __future__ import annotations

import ast
import functools
import re
from typing import Any, Dict, List, Optional, Set, Tuple

from conformance.reproducers.specialise import _case_constant, parsed, segment, walk

__all__ = ["ALIASES", "atomic", "bound_in", "cut", "fold_case_branches", "removed",
           "removed_after_inlining", "simple", "uses_of",
           "without_aliases", "without_blank_lines_in_blocks", "without_empty_kwargs", "without_local_lambdas"]

#: Names the file binds itself (its head), never removed as unread (``STATE`` is, where the case's build reads
#: none: an FSDP2 comm's binding takes the hook alone).
KEPT = {"os", "sys", "torch", "HOOK", "IMPORT_HINT", "CASE", "MODEL"}
#: The names the writer binds per case to what the loop calls (the inputs of a step, the loss): written in place.
ALIASES = {"STEP_INPUTS", "LOSS"}
#: An expression that needs no parentheses wherever it is written.
ATOMIC = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript, ast.List, ast.Dict, ast.Set,
           ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp, ast.JoinedStr)


def atomic(node: ast.expr, text: str) -> bool:
    return isinstance(node, ATOMIC) or (isinstance(node, ast.Tuple) and text.startswith("("))


def simple(node: ast.expr) -> bool:
    """A name, a constant, or a field or constant-index read of one: no call, the same value read twice."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, ast.Attribute):
        return simple(node.value)
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and simple(node.value)


def bound_in(function: Optional[ast.AST]) -> Set[str]:
    """The names a function binds itself (its parameters, what it assigns, the functions, classes, imports and
    exceptions it names), or a block of statements (an ``ast.Module``): the caller's locals."""
    if function is None:
        return set()
    names = set()
    for node in walk(function):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


@functools.lru_cache(maxsize=256)
def uses_of(tree: ast.Module) -> Dict[str, List[ast.AST]]:
    """Where each name is read: a ``Name`` loaded, or an attribute of that name; remembered per tree, as
    :func:`~conformance.reproducers.specialise.parents`."""
    out: Dict[str, List[ast.AST]] = {}
    for node in walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.setdefault(node.id, []).append(node)
        elif isinstance(node, ast.Attribute):
            out.setdefault(node.attr, []).append(node)
    return out


def cut(lines: List[str], node: ast.AST, text: str) -> List[str]:
    l0, c0, l1, c1 = node.lineno, node.col_offset, node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    return lines[:l0 - 1] + [lines[l0 - 1][:c0] + text + lines[l1 - 1][c1:]] + lines[l1:]


def fold_case_branches(source: str, case: Dict[str, Any]) -> str:
    """``x if <test> else y`` whose test reads only ``CASE`` (and constants) written as its branch."""
    while True:
        tree = parsed(source)
        found = next(((n, v) for n in walk(tree) if isinstance(n, ast.IfExp)
                      for v in [_case_constant(n.test, case, {})] if v is not None), None)
        if found is None:
            return source
        node, value = found
        kept = segment(source, node.body if value else node.orelse) or "None"
        source = "\n".join(cut(source.splitlines(), node, kept)) + "\n"


def _lines_of(node: ast.stmt) -> Tuple[int, int]:
    """The first and last line of a statement, its decorators included (1-based)."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return start, node.end_lineno or start


def _with_blank_line(lines: List[str], start: int, end: int) -> int:
    """``end``, or the line after it where a definition of lines ``start`` to ``end`` leaves it blank and the line
    before it is blank too (the blank line that set the definition apart goes with it)."""
    return end + 1 if end < len(lines) and not lines[end].strip() and (start < 2 or not lines[start - 2].strip()) \
        else end


def removed(source: str, names: Set[str], members: Set[str]) -> Tuple[str, Set[str]]:
    """``source`` less the top-level definitions (functions, classes, one-name assignments) and imported names of
    ``names``, and the methods of ``members``, that nothing reads any more; with the names the removed
    definitions read (candidates in their turn)."""
    tree = parsed(source)
    uses = uses_of(tree)
    lines = source.splitlines()
    edits: List[Tuple[int, int, List[str]]] = []  # (first line, last line, what replaces them)
    freed: Set[str] = set()

    def unread(name: str, among: Set[str]) -> bool:
        return name in among and name not in KEPT and not uses.get(name)

    def visit(body: List[ast.stmt], among: Set[str]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, members)
            elif isinstance(node, ast.Try):
                visit(node.body, among)
            bound = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = node.name
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                bound = node.targets[0].id
            if bound is not None and unread(bound, among):
                start, end = _lines_of(node)
                edits.append((start, _with_blank_line(lines, start, end), []))
                freed.update(n.id for n in walk(node) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                kept = [a for a in node.names if not unread((a.asname or a.name).split(".")[0], names)]
                if len(kept) < len(node.names):
                    text = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
                    head = "import " if isinstance(node, ast.Import) else f"from {node.module} import "
                    indent = lines[node.lineno - 1][:node.col_offset]
                    edits.append((node.lineno, node.end_lineno or node.lineno, [indent + head + text] if kept else []))

    visit(tree.body, names)
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = text
    return "\n".join(lines) + "\n", freed


def _bindings(body: List[ast.stmt], name: str) -> List[ast.stmt]:
    """The statements of ``body`` that :func:`removed` would take for a binding of ``name`` (it reads the same
    blocks: the module's, its classes' and its ``try`` bodies'): definitions, one-name assignments, imports."""
    out: List[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.Try)):
            out += _bindings(node.body, name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name or \
                isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and node.targets[0].id == name or \
                isinstance(node, (ast.Import, ast.ImportFrom)) and \
                any((a.asname or a.name).split(".")[0] == name for a in node.names):
            out.append(node)
    return out


def removed_after_inlining(before: ast.Module, source: str, name: str, definition: ast.stmt, call: ast.AST,
                           text: str) -> Optional[str]:
    """``removed(source, {name}, {name})[0]`` without parsing ``source``, or ``None`` where it cannot be told so.

    ``source`` is the text of the tree ``before`` with ``call``, the one read of ``name`` there, written as
    ``text`` (:mod:`conformance.reproducers.inline`); ``definition`` is the function ``name`` binds. Where ``text``
    does not name ``name`` and ``definition`` is the only binding of it :func:`removed` would see, nothing reads
    ``name`` any more, and :func:`removed` would take out ``definition`` alone (with the blank line that set it
    apart): its lines are those of ``before``, moved by the lines ``text`` adds or takes where it comes after the
    call. An edit loop that inlines a dozen helpers a file parses each text once instead of twice.
    """
    if name in KEPT or _bindings(before.body, name) != [definition] or re.search(rf"\b{re.escape(name)}\b", text):
        return None  # (a word of the text, even in a string: the caller then parses, as before)
    start, end = _lines_of(definition)
    first, last = call.lineno, call.end_lineno or call.lineno  # type: ignore[attr-defined]
    if first <= end and start <= last:
        return None  # the call is inside the definition
    if start > last:
        moved = text.count("\n") - (last - first)
        start, end = start + moved, end + moved
    lines = source.splitlines()
    lines[start - 1:_with_blank_line(lines, start, end)] = []
    return "\n".join(lines) + "\n"


def without_empty_kwargs(source: str) -> str:
    """``source`` less each name bound once to ``{}`` and read only as ``**name`` in a call (what a case that claims
    no reduce dtype leaves of ``kwargs = mixed_precision(...)``, ``root_extra = cls._root_fsdp_kwargs(...)``):
    the binding and each ``, **name`` go."""
    while True:
        tree = parsed(source)
        found = None
        for scope in [tree, *(n for n in walk(tree) if isinstance(n, ast.FunctionDef))]:
            own = [n for stmt in scope.body for n in walk(stmt)]
            for stmt in scope.body:
                if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
                        isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Dict) and
                        not stmt.value.keys):
                    continue
                name = stmt.targets[0].id
                names = [n for n in walk(tree) if isinstance(n, ast.Name) and n.id == name]
                spread = [(call, k) for call in walk(tree) if isinstance(call, ast.Call)
                          for k, kw in enumerate(call.keywords)
                          if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == name]
                stores = [n for n in names if not isinstance(n.ctx, ast.Load)]
                if len(stores) == 1 and stores[0] in own and spread and len(names) == 1 + len(spread) and \
                        all(k or call.args for call, k in spread):
                    found = (stmt, spread)
                    break
            if found:
                break
        if found is None:
            return source
        stmt, spread = found
        lines = source.splitlines()
        for call, k in sorted(spread, key=lambda s: (s[0].keywords[s[1]].lineno, s[0].keywords[s[1]].col_offset),
                              reverse=True):
            keyword = call.keywords[k]
            previous = call.keywords[k - 1] if k else max(call.args, key=lambda a: (a.end_lineno, a.end_col_offset))
            if previous.end_lineno != keyword.end_lineno:
                return source
            line = lines[keyword.end_lineno - 1]
            lines[keyword.end_lineno - 1] = line[:previous.end_col_offset] + line[keyword.end_col_offset:]
        del lines[stmt.lineno - 1:stmt.end_lineno]
        source = "\n".join(lines) + "\n"


def without_aliases(source: str) -> str:
    """``source`` with the writer's per-case names (``STEP_INPUTS, LOSS = model_inputs, MODEL.loss``: :data:`ALIASES`)
    written where the loop reads them, and their binding left out."""
    tree = parsed(source)
    binding = next((n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1 and
                    isinstance(n.targets[0], ast.Tuple) and isinstance(n.value, ast.Tuple) and
                    {getattr(t, "id", None) for t in n.targets[0].elts} <= ALIASES), None)
    if binding is None or not all(isinstance(v, (ast.Name, ast.Attribute)) for v in binding.value.elts):
        return source
    texts = {t.id: segment(source, v)  # type: ignore[attr-defined]
             for t, v in zip(binding.targets[0].elts, binding.value.elts)}  # type: ignore[attr-defined]
    reads = [n for n in walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in texts]
    lines = source.splitlines()
    for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        lines = cut(lines, node, texts[node.id] or node.id)
    end = binding.end_lineno or binding.lineno
    if end < len(lines) and not lines[end].strip():
        end += 1
    del lines[binding.lineno - 1:end]
    return "\n".join(lines) + "\n"


def without_local_lambdas(source: str, width: int = 110) -> str:
    """``source`` with each ``name = lambda params: call`` of a function (bound once, at the function's own level)
    written where it is read: a call of it (its arguments names or constants) as the lambda's call, the parameters
    replaced by the arguments; another read as the lambda itself. The same calls: the lambda's names are assigned
    nowhere after it, and it makes no inner scope. Left as written where a line would pass ``width``."""
    for function in [n for n in walk(parsed(source)) if isinstance(n, ast.FunctionDef)]:
        for stmt in function.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Lambda) and isinstance(stmt.value.body, ast.Call)
                    and stmt.lineno == stmt.end_lineno):
                continue
            name, fn = stmt.targets[0].id, stmt.value
            params = [a.arg for a in fn.args.args]
            names = [n for n in walk(function) if isinstance(n, ast.Name) and n.id == name]
            free = {n.id for n in walk(fn.body) if isinstance(n, ast.Name)} - set(params)
            later = {n.id for n in walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
                     and n.lineno >= stmt.lineno} | {a.arg for a in walk(function) if isinstance(a, ast.arg)
                                                     and a.lineno > stmt.lineno}
            if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs or free & later or \
                    len([n for n in names if not isinstance(n.ctx, ast.Load)]) != 1 or \
                    any(isinstance(n, (ast.Lambda, ast.comprehension)) for n in walk(fn.body)):
                continue
            nested = {id(n) for scope in walk(function) if scope is not function and isinstance(
                scope, (ast.FunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp))
                      for n in walk(scope)}
            if any(id(n) in nested for n in names):
                continue  # read in an inner scope, which may bind the lambda's names otherwise
            calls = {id(c.func): c for c in walk(function) if isinstance(c, ast.Call) and
                     isinstance(c.func, ast.Name) and c.func.id == name}
            edits = []
            for read in (n for n in names if isinstance(n.ctx, ast.Load)):
                call = calls.get(id(read))
                if call is None:
                    edits.append((read, segment(source, fn)))
                    continue
                if call.keywords or len(call.args) != len(params) or not all(
                        isinstance(a, (ast.Name, ast.Constant)) for a in call.args):
                    break
                given = dict(zip(params, (segment(source, a) for a in call.args)))
                body = segment(source, fn.body) or ""
                for node in sorted((n for n in walk(fn.body) if isinstance(n, ast.Name) and n.id in given),
                                   key=lambda n: n.col_offset, reverse=True):
                    at, to = node.col_offset - fn.body.col_offset, node.end_col_offset - fn.body.col_offset
                    body = body[:at] + given[node.id] + body[to:]
                edits.append((call, body))
            else:
                lines = source.splitlines()
                for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
                    lines = cut(lines, node, text or "")
                if all(len(lines[node.lineno - 1]) <= width for node, _ in edits):
                    del lines[stmt.lineno - 1]
                    return without_local_lambdas("\n".join(lines) + "\n", width)
    return source


def without_blank_lines_in_blocks(source: str) -> str:
    """``source`` less the blank lines inside a function or class (the file separates its top-level definitions
    alone, as it writes a class's methods one after another) and after a part's heading (what a helper inlined
    away leaves there); a string's lines stay as they are."""
    in_strings = {k for node in walk(parsed(source)) if isinstance(node, ast.JoinedStr) or
                  isinstance(node, ast.Constant) and isinstance(node.value, str)
                  for k in range(node.lineno, node.end_lineno + 1)}
    lines = source.splitlines()
    kept = [line for k, line in enumerate(lines) if line.strip() or k + 1 in in_strings or
            k + 1 < len(lines) and not lines[k + 1][:1].isspace() and not lines[k - 1].startswith("# -- ")]
    return "\n".join(kept) + "\n"
