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
import dataclasses
import importlib
import inspect
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from conformance.reproducers.specialise import literal_constants, parsed, specialised, walk

__all__ = ["bound_names", "written_code"]

#: Methods no code names but that PyTorch or Python call: never pruned from a class.
_CALLED_IMPLICITLY = {"forward", "__init__", "__call__", "__new__", "__enter__", "__exit__", "__iter__",
                      "__post_init__", "__repr__", "__str__"}


class _Definition:
    """One module-level statement of a module: the names it binds, the names it reads, its text."""

    def __init__(self, module: str, node: ast.stmt, lines: List[str]):
        self.module, self.node = module, node
        self.binds = bound_names(node)
        self.reads, self.attrs, self.supers = _read_names(node)
        self.text = _without_docstrings(node, lines)

    @property
    def is_import(self) -> bool:
        return isinstance(self.node, (ast.Import, ast.ImportFrom))


def bound_names(node: ast.stmt) -> Set[str]:
    """The names a module-level statement binds: a definition's, an import's, an assignment's targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for t in targets if t is not None for n in walk(t) if isinstance(n, ast.Name)}


def _read_names(node: ast.stmt) -> Tuple[Set[str], Set[str], Set[str]]:
    """The global names ``node`` reads (its own arguments and assignments left out: a rough but safe cut, as a
    name too many only writes a definition too many), the attribute names it reads, those read on ``super()``."""
    loads, stores, attrs, supers, declared = set(), set(), set(), set(), set()
    for sub in walk(node):
        if isinstance(sub, ast.Global):
            declared.update(sub.names)  # the module's own: assigned here, defined there
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
        loads -= stores - declared  # a function's locals; a class's own attributes
        loads |= declared
    return loads, attrs, supers


def _without_docstrings(node: ast.stmt, lines: List[str]) -> List[str]:
    """``node``'s lines (decorators included) less its docstrings and ``#:`` comments; a body that was its
    docstring alone becomes ``pass``."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    drop: Set[int] = set()
    passes: Dict[int, str] = {}
    for sub in walk(node):
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


def _imports_that_work(node: ast.stmt) -> List[ast.stmt]:
    """Of a module-level ``try: <imports> except ImportError: <imports, another such try, or a fallback>`` (a name's
    home across torch versions), the import statements that run on this torch: the file imports from there, as
    one writes for the torch at hand (``[]`` where none does). Any other statement: ``[node]``."""
    if not isinstance(node, ast.Try):
        return [node]
    imports = (ast.Import, ast.ImportFrom)
    catches = [getattr(h.type, "id", None) for h in node.handlers]
    if not node.body or not all(isinstance(s, imports) for s in node.body) or catches != ["ImportError"] or \
            node.orelse or node.finalbody:
        return [node]
    try:
        exec(compile(ast.Module(body=node.body, type_ignores=[]), "<import>", "exec"), {})
        return list(node.body)
    except ImportError:
        found = [s for stmt in node.handlers[0].body for s in _imports_that_work(stmt)]
        return [s for s in found if isinstance(s, imports)]


def _definitions(module_name: str, case: Optional[Dict[str, Any]] = None,
                 known: Optional[Dict[str, Any]] = None) -> List[_Definition]:
    """Every module-level statement of ``module_name`` but its docstring and ``from __future__``, each ``if``
    on ``CASE`` (or ``known`` names) replaced by the branch ``case`` takes (:func:`specialised`), and a ``try``
    of imports across torch versions by the imports that work here (:func:`_imports_that_work`)."""
    module = importlib.import_module(module_name)
    source = specialised(inspect.getsource(module), case, literal_constants(module), known)
    lines = source.splitlines()
    out = []
    for node in [n for stmt in parsed(source).body for n in _imports_that_work(stmt)]:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in
                                                 ("__future__", "conformance")):
            continue  # what the suite's own modules define is looked up in the modules given
        out.append(_Definition(module_name, node, lines))
    return out


def _member_name(member: ast.stmt) -> Optional[str]:
    """The name a class-body statement binds (``None``: a docstring, a bare annotation)."""
    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return member.name
    if isinstance(member, ast.Assign) and len(member.targets) == 1 and isinstance(member.targets[0], ast.Name):
        return member.targets[0].id
    if isinstance(member, ast.AnnAssign) and member.value is not None and isinstance(member.target, ast.Name):
        return member.target.id
    return None


class _Pruned:
    """A class of the model's ancestry, written with the members the file's code reaches only."""

    def __init__(self, definition: _Definition, cls: type, model: type, metadata: Set[str]):
        self.definition, self.cls, self.model, self.metadata = definition, cls, model, metadata
        node = definition.node
        self.members = [(m, _member_name(m)) for m in node.body]
        self.kept: Set[int] = set()
        header = ast.ClassDef(name=node.name, bases=node.bases, keywords=node.keywords, body=[],
                              decorator_list=node.decorator_list)
        self.reads = _read_names(header)[0]  # its bases and decorators

    def owner(self, name: str) -> Optional[type]:
        """The class whose ``name`` the file's instances use: the model's, or this class's own."""
        mro = self.model.__mro__ if isinstance(self.model, type) and issubclass(self.model, self.cls) else \
            self.cls.__mro__
        return next((c for c in mro if name in vars(c)), None)

    def wanted(self, k: int, attrs: Set[str], supers: Set[str]) -> bool:
        """Whether member ``k`` runs: the model takes it from this class and some code names it (or Python and
        PyTorch call it: ``forward``, ``__init__``), or the class that hides it calls it on ``super()``."""
        member, name = self.members[k]
        if isinstance(member, ast.AnnAssign) and dataclasses.is_dataclass(self.cls):
            return True  # a field: the generated __init__ takes it
        if name is None or name in self.metadata:
            return False  # the suite's metadata on a model: kept at the end where the code reads it (written_code)
        if self.owner(name) is self.cls:
            return name in attrs or name in _CALLED_IMPLICITLY
        return name in supers

    def text(self, lines: List[str]) -> str:
        node = self.definition.node
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out = lines[start - 1:node.body[0].lineno - 1]
        while out and not out[-1].rstrip().endswith(":"):  # a docstring's first line left on the header
            out.pop()
        for k in sorted(self.kept):
            out.extend(_without_docstrings(self.members[k][0], lines))
        if not self.kept:
            out.append(" " * (node.col_offset + 4) + "pass")
        return "\n".join(out)


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
                 model: Optional[type] = None, prune: Sequence[type] = (), also_reads: str = "",
                 case: Optional[Dict[str, Any]] = None, known: Optional[Dict[str, Dict[str, Any]]] = None
                 ) -> Tuple[List[str], Dict[str, List[str]]]:
    """``(imports, definitions by module)``: the import lines and the definitions (each a text) of ``modules``
    that the names ``roots`` reach, following the global names each definition reads; each module's in its
    own order (a base class before its subclass, a constant before the code that reads it when the module
    runs).

    ``provided``: names the file binds itself (not looked up). ``model``: the model class the file trains,
    whose methods decide what is kept of the classes in ``prune`` (a method the model takes from another
    class, or that no written code names, is left out). ``also_reads``: code the file holds beside the
    definitions (the writer's bindings), whose names and attributes are followed too. ``case``: the file's
    ``CASE``; an ``if`` on it alone is written as the branch the case takes, and so is one on the names ``known``
    gives a module (``{module: {name: value}}``). A name bound in two modules takes
    the later module's definition (an API's part may override a shared helper's).
    """
    table: Dict[str, _Definition] = {}
    order: List[_Definition] = []
    for module_name in modules:
        for definition in _definitions(module_name, case, (known or {}).get(module_name)):
            order.append(definition)
            for name in definition.binds:
                table[name] = definition
    prunable = {(c.__module__, c.__name__): c for c in prune}
    # The suite's metadata on a model (``ReferenceModel``'s ``ClassVar`` s: ``name``, ``fsdp_units``): written
    # where the file's code reads it on the model (``cls.name``), not for a ``.name`` read on anything else.
    metadata = {k for c in prune for k, v in vars(c).get("__annotations__", {}).items() if str(v).startswith("ClassVar")}
    skip = set(provided) | set(dir(builtins))
    seen: Set[int] = set()
    pruned: Dict[int, _Pruned] = {}
    reads: Set[str] = set()
    attrs: Set[str] = set()
    supers: Set[str] = set()
    extra = parsed(also_reads or "None")
    attrs |= {n.attr for n in walk(extra) if isinstance(n, ast.Attribute)}
    todo = [*roots, *(n.id for n in walk(extra) if isinstance(n, ast.Name))]
    while todo:
        while todo:
            name = todo.pop()
            definition = table.get(name)
            if name in skip or definition is None or id(definition) in seen:
                continue
            seen.add(id(definition))
            cls = prunable.get((definition.module, name))
            if cls is not None:
                pruned[id(definition)] = _Pruned(definition, cls, model, metadata)
                found = (pruned[id(definition)].reads, set(), set())
            else:
                found = (definition.reads, definition.attrs, definition.supers)
            reads |= found[0]
            attrs |= found[1]
            supers |= found[2]
            todo.extend(found[0])
        for part in pruned.values():  # the members the code reached so far runs: what they read runs too
            for k, (member, _) in enumerate(part.members):
                if k not in part.kept and part.wanted(k, attrs, supers):
                    part.kept.add(k)
                    member_reads, member_attrs, member_supers = _read_names(member)
                    reads |= member_reads
                    attrs |= member_attrs
                    supers |= member_supers
                    todo.extend(member_reads)
        if not todo and any(k not in p.kept and p.wanted(k, attrs, supers)
                            for p in pruned.values() for k in range(len(p.members))):
            todo.append("")  # one more round: a member reached another
    on_model = {n.attr for tree in [extra, *(d.node for d in order if id(d) in seen)] for n in walk(tree)
                if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) in ("cls", "self", "MODEL")}
    imports: List[str] = []
    bound = set(provided)
    texts: Dict[str, List[str]] = {m: [] for m in modules}
    for definition in order:
        if id(definition) not in seen:
            continue
        if definition.is_import:
            imports.extend(_import_lines(definition.node, reads, bound))
        elif id(definition) in pruned:
            part = pruned[id(definition)]
            part.kept |= {k for k, (_, name) in enumerate(part.members) if name in metadata & on_model}
            module = importlib.import_module(definition.module)
            lines = specialised(inspect.getsource(module), case, literal_constants(module),
                                 (known or {}).get(definition.module)).splitlines()
            texts[definition.module].append(pruned[id(definition)].text(lines))
        else:
            texts[definition.module].append("\n".join(definition.text))
    return imports, texts

