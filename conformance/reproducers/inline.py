"""A written reproducer's single-use helpers inlined where its case calls them, and what that leaves unread removed.

The file's code is the suite's (:mod:`conformance.reproducers.sources`), and the suite
reaches its model and its build through small helpers that serve every config and model
(``subgroup(ranks)`` that returns ``ranks`` outside the subgroup configs, ``mesh_shape``,
``bind_comm``, a model's ``_world_size``). Where the file calls such a helper once, and the
helper is one ``return`` of one line, :func:`inlined` writes the expression at the call, its
parameters replaced by the call's arguments, and drops the helper; an ``x if <CASE test> else
y`` the case decides is written as its branch. What no code reads any more (the helper, an
import) goes too. The file runs the same calls as before, in the same order: an argument is
written in place of its parameter only where the parameter is read once (outside a ``lambda``
or a comprehension) or the argument is a name, a constant or a field read, and an argument
the helper does not read is dropped only where it is one of those.

Raises nothing: a call that does not fit these rules is left as written.
"""

from __future__ import annotations

import ast
from typing import Any, Dict, List, Optional, Set, Tuple

from conformance.reproducers.specialise import _case_constant

__all__ = ["inlined"]

#: Lines a replacement may make: the width of the file's headings (a longer line is read less easily than the call).
WIDTH = 110
#: Names the file binds itself (its head), never removed as unread.
_KEPT = {"os", "sys", "torch", "HOOK", "STATE", "IMPORT_HINT", "CASE", "MODEL", "STEP_INPUTS", "LOSS"}
#: An expression that needs no parentheses wherever it is written.
_ATOMIC = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript, ast.List, ast.Dict, ast.Set,
           ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp, ast.JoinedStr)


def _atomic(node: ast.expr, text: str) -> bool:
    return isinstance(node, _ATOMIC) or (isinstance(node, ast.Tuple) and text.startswith("("))


def _simple(node: ast.expr) -> bool:
    """A name, a constant, or a field or constant-index read of one: no call, the same value read twice."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, ast.Attribute):
        return _simple(node.value)
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and _simple(node.value)


class _Helper:
    """A function of one ``return`` of one line: top-level, or a private method (first parameter the receiver)."""

    def __init__(self, node: ast.FunctionDef, owner: Optional[str]):
        self.node, self.owner, self.name = node, owner, node.name
        decorators = [getattr(d, "id", None) for d in node.decorator_list]
        self.static = decorators == ["staticmethod"]
        self.expr: ast.expr = node.body[0].value  # type: ignore[attr-defined]

    @staticmethod
    def of(node: ast.stmt, owner: Optional[str]) -> Optional["_Helper"]:
        if not isinstance(node, ast.FunctionDef) or len(node.body) != 1 or \
                not isinstance(node.body[0], ast.Return) or node.body[0].value is None:
            return None
        value = node.body[0].value
        if value.lineno != value.end_lineno or node.args.vararg or node.args.kwarg:
            return None
        if owner is not None:
            decorators = [getattr(d, "id", None) for d in node.decorator_list]
            if not node.name.startswith("_") or node.name.startswith("__") or \
                    decorators not in ([], ["classmethod"], ["staticmethod"]):
                return None
        elif node.decorator_list:
            return None
        return _Helper(node, owner)

    def params(self) -> Tuple[List[ast.arg], List[Optional[ast.expr]]]:
        """The parameters a call binds (a method's receiver first), with their defaults."""
        args = self.node.args
        positional = args.posonlyargs + args.args
        defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        return positional + args.kwonlyargs, defaults + list(args.kw_defaults)


def _parents(tree: ast.AST) -> Dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _bound_in(function: Optional[ast.AST]) -> Set[str]:
    """The names a function binds itself (its parameters, what it assigns): the caller's locals."""
    if function is None:
        return set()
    names = {a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    return names | {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}


def _helpers(tree: ast.Module) -> Dict[str, List[_Helper]]:
    """Every function of the file by name (a method's under its name too), the one-``return`` ones as helpers;
    a name defined twice maps to a list of two (never inlined)."""
    out: Dict[str, List[Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.setdefault(member.name, []).append(_Helper.of(member, node.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, []).append(_Helper.of(node, None))
    return out


def _uses(tree: ast.Module) -> Dict[str, List[ast.AST]]:
    """Where each name is read: a ``Name`` loaded, or an attribute of that name."""
    out: Dict[str, List[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.setdefault(node.id, []).append(node)
        elif isinstance(node, ast.Attribute):
            out.setdefault(node.attr, []).append(node)
    return out


def _replacement(helper: _Helper, call: ast.Call, source: str, caller_locals: Set[str]) -> Optional[str]:
    """The helper's expression for ``call``, or ``None`` where the rules of the module do not allow it."""
    params, defaults = helper.params()
    bound: Dict[str, ast.expr] = {}
    given = list(call.args)
    if helper.owner is not None and not helper.static:
        if not isinstance(call.func, ast.Attribute):
            return None
        given.insert(0, call.func.value)
    if any(isinstance(a, ast.Starred) for a in given) or any(k.arg is None for k in call.keywords):
        return None
    positional = params[:len(helper.node.args.posonlyargs + helper.node.args.args)]
    if len(given) > len(positional):
        return None
    for param, arg in zip(positional, given):
        bound[param.arg] = arg
    for keyword in call.keywords:
        if keyword.arg in bound or keyword.arg not in {p.arg for p in params}:
            return None
        bound[keyword.arg] = keyword.value  # type: ignore[index]
    for param, default in zip(params, defaults):
        if param.arg not in bound:
            if default is None:
                return None
            bound[param.arg] = default
    expr = helper.expr
    expr_source = ast.get_source_segment(source, expr) or ""
    local_scopes = [n for n in ast.walk(expr) if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                                                  ast.GeneratorExp))]
    in_scope = {id(n) for scope in local_scopes for n in ast.walk(scope)}
    reads: Dict[str, List[ast.Name]] = {}
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.id, []).append(node)
    inner = _bound_in(ast.Module(body=[ast.Expr(s) for s in local_scopes], type_ignores=[]))
    if any(name not in bound and name not in inner and name in caller_locals for name in reads):
        return None  # the helper reads a global the caller's local would hide
    texts: Dict[str, str] = {}
    for name, arg in bound.items():
        text = ast.get_source_segment(source, arg) if arg is not None else None
        if text is None or "\n" in text:
            return None
        uses = reads.get(name, [])
        if not _simple(arg) and (len(uses) != 1 or id(uses[0]) in in_scope):
            return None
        texts[name] = text if _atomic(arg, text) else f"({text})"
    offset = expr.col_offset
    pieces = sorted(((n.col_offset - offset, n.end_col_offset - offset, texts[n.id])
                     for name in bound for n in reads.get(name, [])), reverse=True)
    for start, end, text in pieces:
        expr_source = expr_source[:start] + text + expr_source[end:]
    return expr_source


def _cut(lines: List[str], node: ast.AST, text: str) -> List[str]:
    l0, c0, l1, c1 = node.lineno, node.col_offset, node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    return lines[:l0 - 1] + [lines[l0 - 1][:c0] + text + lines[l1 - 1][c1:]] + lines[l1:]


def _inline_one(source: str) -> Optional[Tuple[str, str]]:
    """``(source with one helper inlined, the helper's name)``, or ``None`` where none is left."""
    tree = ast.parse(source)
    parents = _parents(tree)
    uses = _uses(tree)
    for name, helpers in _helpers(tree).items():
        if len(helpers) != 1 or helpers[0] is None or len(uses.get(name, [])) != 1:
            continue
        helper, use = helpers[0], uses[name][0]
        is_method = helper.owner is not None
        if is_method != isinstance(use, ast.Attribute):
            continue
        call = parents.get(id(use))
        if not isinstance(call, ast.Call) or call.func is not use:
            continue
        caller = call
        while caller is not None and not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            caller = parents.get(id(caller))
        if caller is helper.node:
            continue  # recursive
        text = _replacement(helper, call, source, _bound_in(caller))
        if text is None:
            continue
        parent = parents.get(id(call))
        alone = isinstance(parent, (ast.Assign, ast.Return, ast.Expr, ast.keyword, ast.Call, ast.List, ast.AnnAssign))
        if not alone and not _atomic(helper.expr, text):
            text = f"({text})"
        lines = _cut(source.splitlines(), call, text)
        if any(len(line) > WIDTH for line in lines[call.lineno - 1:call.lineno]):
            continue
        return "\n".join(lines) + "\n", name
    return None


def _fold_case_branches(source: str, case: Dict[str, Any]) -> str:
    """``x if <test> else y`` whose test reads only ``CASE`` (and constants) written as its branch."""
    while True:
        tree = ast.parse(source)
        found = next(((n, v) for n in ast.walk(tree) if isinstance(n, ast.IfExp)
                      for v in [_case_constant(n.test, case, {})] if v is not None), None)
        if found is None:
            return source
        node, value = found
        kept = ast.get_source_segment(source, node.body if value else node.orelse) or "None"
        source = "\n".join(_cut(source.splitlines(), node, kept)) + "\n"


def _removed(source: str, names: Set[str], members: Set[str]) -> Tuple[str, Set[str]]:
    """``source`` less the top-level definitions (functions, classes, one-name assignments) and imported names of
    ``names``, and the methods of ``members``, that nothing reads any more; with the names the removed
    definitions read (candidates in their turn)."""
    tree = ast.parse(source)
    uses = _uses(tree)
    lines = source.splitlines()
    edits: List[Tuple[int, int, List[str]]] = []  # (first line, last line, what replaces them)
    freed: Set[str] = set()

    def unread(name: str, among: Set[str]) -> bool:
        return name in among and name not in _KEPT and not uses.get(name)

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
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                end = node.end_lineno or start
                if end < len(lines) and not lines[end].strip() and (start < 2 or not lines[start - 2].strip()):
                    end += 1  # the blank line that set it apart
                edits.append((start, end, []))
                freed.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
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


def inlined(source: str, case: Dict[str, Any]) -> str:
    """``source`` (a written reproducer) with its single-use one-line helpers inlined (see the module), the case's
    branch of each ``x if <CASE test> else y`` kept, and what no code reads any more removed."""
    inlined_names: Set[str] = set()
    while True:
        step = _inline_one(source)
        if step is None:
            break
        source, name = step
        inlined_names.add(name)
    source = _fold_case_branches(source, case)
    candidates = inlined_names | {(a.asname or a.name).split(".")[0] for n in ast.walk(ast.parse(source))
                                  if isinstance(n, (ast.Import, ast.ImportFrom)) and
                                  getattr(n, "module", None) != "__future__" for a in n.names}
    while candidates:
        source, freed = _removed(source, candidates, inlined_names)
        candidates = freed - inlined_names
    return source
