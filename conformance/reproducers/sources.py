"""The code a reproducer writes in: only the definitions its case runs, read from the suite's own modules.

:func:`written_code` starts from the names the case needs (the loop's ``run``, the API's
``build``, the model's class) and follows every global name their code reads, in the
modules it is given, to the module-level definitions behind it: a function, a class, a
constant, an import. What no root reaches is left out (the other models of a module, the
configs of other APIs, the hard inputs' decoding in a parity case). A class is written whole,
except the reference models' base class (:class:`conformance.models.base.ReferenceModel`),
which keeps only the methods the model inherits and that the written code calls. The code is
the suite's, character for character, less its docstrings and its ``#:`` comments (the
suite's documentation, not the case's); a body left empty gets ``pass``.

Raises nothing of its own: a name no module defines is left for the file's other parts (the
case's ``CASE``, ``HOOK``, ``STATE``, ``MODEL``, the names the writer binds per case).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = ["written_code"]

#: Methods no code names but that PyTorch or Python call: never pruned from a class.
_CALLED_IMPLICITLY = {"forward", "__init__", "__call__", "__new__", "__enter__", "__exit__", "__iter__"}


class _Definition:
    """One module-level statement of a module: the names it binds, the names it reads, its text."""

    def __init__(self, module: str, node: ast.stmt, lines: List[str]):
        self.module, self.node = module, node
        self.binds = _bound_names(node)
        self.reads, self.attrs, self.supers = _read_names(node)
        self.text = _without_docstrings(node, lines)

    @property
    def is_import(self) -> bool:
        return isinstance(self.node, (ast.Import, ast.ImportFrom))


def _bound_names(node: ast.stmt) -> Set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def _read_names(node: ast.stmt) -> Tuple[Set[str], Set[str], Set[str]]:
    """The global names ``node`` reads (its own arguments and assignments left out: a rough but safe cut, as a
    name too many only writes a definition too many), the attribute names it reads, those read on ``super()``."""
    loads, stores, attrs, supers = set(), set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loads if isinstance(sub.ctx, ast.Load) else stores).add(sub.id)
        elif isinstance(sub, ast.arg):
            stores.add(sub.arg)
        elif isinstance(sub, ast.Attribute):
            attrs.add(sub.attr)
            if isinstance(sub.value, ast.Call) and getattr(sub.value.func, "id", None) == "super":
                supers.add(sub.attr)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return set(), set(), set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        loads -= stores  # a function's locals; a class's own attributes
    return loads, attrs, supers


def _without_docstrings(node: ast.stmt, lines: List[str]) -> List[str]:
    """``node``'s lines (decorators included) less its docstrings and ``#:`` comments; a body that was its
    docstring alone becomes ``pass``."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    drop: Set[int] = set()
    passes: Dict[int, str] = {}
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                drop.update(range(first.lineno, first.end_lineno + 1))
                if len(body) == 1:
                    passes[first.lineno] = " " * first.col_offset + "pass"
    out = []
    for number in range(start, node.end_lineno + 1):
        if number in passes:
            out.append(passes[number])
        elif number not in drop and not lines[number - 1].lstrip().startswith("#:"):
            out.append(lines[number - 1])
    return out


def _definitions(module_name: str) -> List[_Definition]:
    """Every module-level statement of ``module_name`` but its docstring and ``from __future__``."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    lines = source.splitlines()
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in
                                                 ("__future__", "conformance")):
            continue  # what the suite's own modules define is looked up in the modules given
        out.append(_Definition(module_name, node, lines))
    return out


def _pruned_class(definition: _Definition, model: Optional[type], attrs: Set[str], supers: Set[str]) -> str:
    """The base class's text with only the methods ``model`` inherits from it (or calls on ``super()``) and some
    written code names; class-level annotations without a value, and values no code reads, dropped."""
    node = definition.node
    base = getattr(importlib.import_module(definition.module), node.name)
    lines = inspect.getsource(importlib.import_module(definition.module)).splitlines()
    kept: List[str] = [lines[node.lineno - 1]]
    for member in node.body:
        name = getattr(member, "name", None) or next(iter(_bound_names(member)), None)
        if name is None or (isinstance(member, ast.Expr)):
            continue
        owner = next((c for c in (model.__mro__ if model else ()) if name in vars(c)), None)
        inherited = owner is base or name in supers
        if name in _CALLED_IMPLICITLY:
            wanted = inherited
        else:
            wanted = inherited and name in attrs
        if isinstance(member, ast.AnnAssign) and member.value is None:
            wanted = False
        if wanted:
            kept.extend(_without_docstrings(member, lines))
    if len(kept) == 1:
        kept.append(" " * (node.col_offset + 4) + "pass")
    return "\n".join(kept)


def _import_lines(node: ast.stmt, used: Set[str], bound: Set[str]) -> List[str]:
    """The import statement ``node`` with only the names of ``used`` not yet in ``bound`` (none: no line); the
    names it writes are added to ``bound``."""
    def wanted(alias: ast.alias) -> bool:
        name = (alias.asname or alias.name).split(".")[0]
        return name in used and name not in bound and not bound.add(name)

    if isinstance(node, ast.Import):
        return [f"import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names if wanted(a)]
    names = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names if wanted(a)]
    return [f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"] if names else []


def written_code(roots: Iterable[str], modules: Sequence[str], provided: Iterable[str] = (),
                 model: Optional[type] = None, prune: Sequence[type] = ()) -> Tuple[List[str], Dict[str, List[str]]]:
    """``(imports, definitions by module)``: the import lines and the definitions (each a text) of ``modules``
    that the names ``roots`` reach, following the global names each definition reads; each module's in its
    own order (a base class before its subclass, a constant before the code that reads it when the module
    runs).

    ``provided``: names the file binds itself (not looked up). ``model``: the model class the file trains,
    whose inherited methods decide what is kept of the classes in ``prune``. A name bound in two modules takes
    the later module's definition (an API's part may override a shared helper's).
    """
    table: Dict[str, _Definition] = {}
    order: List[_Definition] = []
    for module_name in modules:
        for definition in _definitions(module_name):
            order.append(definition)
            for name in definition.binds:
                table[name] = definition
    skip = set(provided) | set(dir(builtins))
    seen: Set[int] = set()
    reads: Set[str] = set()
    attrs: Set[str] = set()
    supers: Set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        definition = table.get(name)
        if name in skip or definition is None or id(definition) in seen:
            continue
        seen.add(id(definition))
        reads |= definition.reads
        attrs |= definition.attrs
        supers |= definition.supers
        todo.extend(definition.reads)
    pruned = {c.__name__ for c in prune}
    imports: List[str] = []
    bound = set(provided)
    texts: Dict[str, List[str]] = {m: [] for m in modules}
    for definition in order:
        if id(definition) not in seen:
            continue
        if definition.is_import:
            imports.extend(_import_lines(definition.node, reads, bound))
        elif isinstance(definition.node, ast.ClassDef) and definition.node.name in pruned:
            texts[definition.module].append(_pruned_class(definition, model, attrs, supers))
        else:
            texts[definition.module].append("\n".join(definition.text))
    return imports, texts
