"""A reproducer's code as its case runs it: each ``if`` the case decides written as its branch, each field of a
known config written as its value (:mod:`conformance.reproducers.sources` reads the suite's modules through
:func:`specialised`).

An ``if`` whose test reads only ``CASE`` (or names whose value is the same wherever the file reads them, the
*known* names an API's part gives: an FSDP2 file's config ``layout``, its ``SETUP``, the model class ``cls``)
becomes the branch the case takes; a field of a known config (``layout.mesh``, ``SETUP.setter``) becomes its
literal, or its function's name; ``getattr(x, "name")`` becomes ``x.name``; the known config itself (its
parameter, the argument passed to it, its assignment) is left out, so the file holds no setup object.
"""

from __future__ import annotations

import ast
import collections
import functools
import inspect
import re
import warnings
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Tuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

__all__ = ["literal_constants", "parents", "parsed", "segment", "specialised", "walk"]

#: A field a known config does not have (:func:`_fold`).
_MISSING = object()

#: A line of a source with its end (``\r\n``, ``\r`` or ``\n``), as :func:`ast.get_source_segment` splits it.
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


@functools.lru_cache(maxsize=512)
def parsed(source: str) -> ast.Module:
    """``ast.parse(source)``, remembered: the writer's edits read the same texts again and again (a definition, the
    file between two edits). The tree is shared, so no caller may change it; the edits change the text instead."""
    return ast.parse(source)


def _index(tree: ast.AST) -> Tuple[Tuple[ast.AST, ...], Dict[int, ast.AST]]:
    """Every node of ``tree`` in :func:`ast.walk`'s order, and ``{id(node): its parent}``, in one pass without
    ``ast.walk``'s generators (two per node, most of a reproducer's cost), kept on the tree itself (a tree lives
    as long as :func:`parsed` keeps its text; no field of it changes)."""
    known = getattr(tree, "_conformance_index", None)
    if known is not None:
        return known
    order: List[ast.AST] = [tree]
    parent: Dict[int, ast.AST] = {}
    node_type = ast.AST
    for node in order:  # breadth first, as ast.walk: the list grows behind the loop
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, node_type):
                parent[id(value)] = node
                order.append(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, node_type):
                        parent[id(item)] = node
                        order.append(item)
    index = (tuple(order), parent)
    tree._conformance_index = index  # type: ignore[attr-defined]
    return index


def walk(node: ast.AST) -> Tuple[ast.AST, ...]:
    """``tuple(ast.walk(node))``: the same nodes in the same order, about three times as fast; remembered for a
    module's tree (:func:`parsed` shares one tree per text: read it, never change it), not for its parts."""
    if isinstance(node, ast.Module):
        return _index(node)[0]
    # _index's loop without the parents: one loop for both, with a list of each field's children, made a
    # module's index 30 % slower, and the index is what every edit of the inline loop waits on
    order: List[ast.AST] = [node]
    node_type = ast.AST
    for current in order:
        for name in current._fields:
            value = getattr(current, name, None)
            if isinstance(value, node_type):
                order.append(value)
            elif isinstance(value, list):
                order.extend([item for item in value if isinstance(item, node_type)])
    return tuple(order)


def parents(tree: ast.AST) -> Dict[int, ast.AST]:
    """``{id(node): its parent}`` over ``tree``, remembered per tree (:func:`parsed` shares one tree per text): read
    it, never change it."""
    return _index(tree)[1]


@functools.lru_cache(maxsize=16)
def _lines(source: str) -> Tuple[str, ...]:
    return tuple(_LINE.findall(source))


def segment(source: str, node: ast.AST) -> Optional[str]:
    """:func:`ast.get_source_segment` of ``node`` (the same text, or ``None``), with ``source`` split into lines
    once for every node read from it: ``ast`` splits it again, one character at a time, for each node, and a
    reproducer's edits read thousands of nodes of one file."""
    end_lineno, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if end_lineno is None or end_col is None or getattr(node, "lineno", None) is None:
        return None
    lines = _lines(source)
    first, last = node.lineno - 1, end_lineno - 1  # type: ignore[attr-defined]
    if first == last:
        return lines[first].encode()[node.col_offset:end_col].decode()  # type: ignore[attr-defined]
    return "".join([lines[first].encode()[node.col_offset:].decode(), *lines[first + 1:last],  # type: ignore[attr-defined]
                    lines[last].encode()[:end_col].decode()])


#: The builtins an ``if`` test decided at writing time may call (:func:`_case_constant`).
_PURE_BUILTINS = {"hasattr": hasattr, "isinstance": isinstance, "len": len}


def _case_constant(test: ast.expr, case: Optional[Dict[str, Any]], constants: Dict[str, Any],
                   known: Optional[Dict[str, Any]] = None) -> Optional[bool]:
    """The truth of an ``if`` test that reads ``CASE`` or a ``known`` name (a name whose value is the same
    wherever the file's code reads it: an FSDP2 file's ``layout``, the case's config) and nothing else but
    torch's dtypes, the module's literal constants (``constants``) and :data:`_PURE_BUILTINS`, evaluated on
    ``case``; ``None`` where it reads anything else or calls anything but a method or those builtins."""
    if case is None:
        return None
    known = known or {}
    if isinstance(test, ast.BoolOp):  # decided by one operand where it decides: `layout.hooked_dim and hooked`
        decides = isinstance(test.op, ast.Or)
        if any(_case_constant(v, case, constants, known) is decides for v in test.values):
            return decides
    names = {n.id for n in walk(test) if isinstance(n, ast.Name)}
    calls = [n for n in walk(test) if isinstance(n, ast.Call)]
    literal = not names and not calls  # what a folded field leaves: `'pool' == "subgroup"`
    if not (literal or names & {"CASE", *known}) or \
            not names <= {"CASE", "torch", *constants, *known, *_PURE_BUILTINS} or \
            any(not isinstance(c.func, ast.Attribute) and getattr(c.func, "id", None) not in _PURE_BUILTINS
                for c in calls):
        return None
    try:
        with warnings.catch_warnings():  # `None is not None`, what a folded field leaves, warns
            warnings.simplefilter("ignore", SyntaxWarning)
            code = compile(ast.Expression(test), "<case>", "eval")
        return bool(eval(code,
                         {"__builtins__": dict(_PURE_BUILTINS), **constants, **known, "CASE": case, "torch": torch}))
    except Exception:  # noqa: BLE001 - not decidable from the case: the file keeps the test
        return None


def literal_constants(module: ModuleType) -> Dict[str, Any]:
    """The module's globals bound to a string, number, ``None`` or dtype (a config's name, a factor)."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("__") and (v is None or isinstance(v, (str, int, float, torch.dtype)))}


@functools.lru_cache(maxsize=64)
def _case_keys(source: str) -> Optional[Tuple[str, ...]]:
    """The keys of ``CASE`` the code of ``source`` reads, each by a literal (``CASE["model"]``,
    ``CASE.get("nodes")``); ``None`` where it reads ``CASE`` any other way (the whole case then matters)."""
    tree = parsed(source)
    parent = parents(tree)
    keys = set()
    for node in walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "CASE"):
            continue
        up = parent.get(id(node))
        call = parent.get(id(up))
        if isinstance(up, ast.Subscript) and up.value is node and isinstance(up.slice, ast.Constant):
            key = up.slice.value
        elif isinstance(up, ast.Attribute) and up.attr == "get" and isinstance(call, ast.Call) and call.func is up \
                and call.args and isinstance(call.args[0], ast.Constant):
            key = call.args[0].value
        else:
            return None
        if not isinstance(key, str):
            return None
        keys.add(key)
    return tuple(sorted(keys))


def _plain(value: object) -> Optional[str]:
    """A text that only an equal value of the same type gives (``None`` where ``repr`` names an object's address,
    which a later object may reuse)."""
    if isinstance(value, dict):
        items = [(_plain(k), _plain(v)) for k, v in value.items()]
        return None if any(k is None or v is None for k, v in items) else repr(sorted(items))
    text = f"{type(value).__module__}.{type(value).__qualname__}:{value!r}"
    return None if " at 0x" in text else text


def _memo_key(source: str, case: Optional[Dict[str, Any]], constants: Dict[str, Any],
              known: Optional[Dict[str, Any]]) -> Optional[Hashable]:
    """What :func:`specialised`'s result depends on: the source, the entries of ``case`` its code reads, the
    constants and the known names; ``None`` where that cannot be told (nothing is remembered then)."""
    if case is None:
        case_part: Optional[str] = "no case"
    else:
        keys = _case_keys(source)
        case_part = _plain(case if keys is None else {k: (k in case, case.get(k)) for k in keys})
    parts = (case_part, _plain(constants), _plain(known or {}))
    return None if None in parts else (source, *parts)


#: :func:`specialised`'s results, the latest :data:`_KEEP` (a reproducer reads the same modules, most of them for
#: the same case entries, as the one before it: the suite's, its model's and its API's).
_SPECIALISED: "collections.OrderedDict[Hashable, str]" = collections.OrderedDict()
_KEEP = 256


def specialised(source: str, case: Optional[Dict[str, Any]], constants: Dict[str, Any],
                known: Optional[Dict[str, Any]] = None) -> str:
    """``source`` with every ``if`` (or ``elif``) whose test reads only ``CASE`` (or ``known`` names:
    :func:`_case_constant`) replaced by the branch the case takes, the file holds its case's path alone: a top
    ``if`` by its branch's body, dedented into place (``pass`` where it has none and its block nothing else);
    an ``elif`` by an ``else`` holding that body, or by nothing. Remembered for the same source, the same
    entries of ``case`` its code reads, constants and known names (:func:`_memo_key`)."""
    key = _memo_key(source, case, constants, known)
    if key is None:
        return _specialised(source, case, constants, known)
    if key not in _SPECIALISED:
        _SPECIALISED[key] = _specialised(source, case, constants, known)
        if len(_SPECIALISED) > _KEEP:
            _SPECIALISED.popitem(last=False)
    _SPECIALISED.move_to_end(key)
    return _SPECIALISED[key]


def _specialised(source: str, case: Optional[Dict[str, Any]], constants: Dict[str, Any],
                 known: Optional[Dict[str, Any]]) -> str:
    while True:
        lines = source.splitlines()
        found = next(((n, v) for n in walk(parsed(source)) if isinstance(n, ast.If)
                      for v in [_case_constant(n.test, case, constants, known)] if v is not None), None)
        if found is None:
            folded = _fold(source, known) if known else None
            if folded is not None:
                source = folded
                continue
            return _without_spare_pass(_without_dead_code(source))
        node, value = found
        first = lines[node.lineno - 1]
        indent = first[:len(first) - len(first.lstrip())]
        is_elif = first.lstrip().startswith("elif")
        body = lines[node.body[0].lineno - 1:node.body[-1].end_lineno]
        rest = lines[node.orelse[0].lineno - 1:node.orelse[-1].end_lineno] if node.orelse else []
        rest_is_elif = bool(rest) and rest[0].lstrip().startswith("elif")
        if value:
            kept = [indent + "else:"] + body if is_elif else _dedented(body, len(indent))
        elif rest_is_elif:
            kept = rest if is_elif else [rest[0].replace("elif", "if", 1)] + rest[1:]
        elif rest:
            kept = [indent + "else:"] + rest if is_elif else _dedented(rest, len(indent))
        else:
            kept = [] if is_elif else [indent + "pass"]  # removed again where its block holds more
        end = (node.orelse[-1] if node.orelse else node.body[-1]).end_lineno
        source = "\n".join(lines[:node.lineno - 1] + kept + lines[end:]) + "\n"


def _literal_text(value: object) -> Optional[str]:
    """``value`` as Python source where it is a literal (``None``, a bool, number, string, dtype, a tuple of
    these) or a module-level function (its name, which the file then defines); else ``None``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.dtype):
        return f"torch.{str(value).rsplit('.', 1)[-1]}"
    if isinstance(value, tuple):
        items = [_literal_text(v) for v in value]
        return None if None in items else "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if inspect.isfunction(value) and value.__qualname__ == value.__name__:
        return value.__name__
    return None


def _known_value(node: ast.expr, known: Dict[str, Any]) -> Tuple[bool, Any]:
    """``(True, value)`` where ``node`` is a known name that holds data (a config, not a class or a function),
    or a call without arguments of a known function (``_layout()``); else ``(False, None)``."""
    if isinstance(node, ast.Name) and node.id in known and not callable(known[node.id]):
        return True, known[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args and not node.keywords \
            and callable(known.get(node.func.id)) and not inspect.isclass(known[node.func.id]):
        return True, known[node.func.id]()
    return False, None


def _fold(source: str, known: Dict[str, Any]) -> Optional[str]:
    """``source`` with one read of a known value folded, or ``None`` where none is left: a field of a known config
    (``layout.mesh``, ``_layout().sync_setter``, ``SETUP.bind``) as its literal or its function's name;
    ``getattr(x, "name")`` as ``x.name``; and a known config itself, which the file then holds nowhere: its
    parameter, the argument passed to it and its assignment are left out."""
    tree = parsed(source)
    lines = source.splitlines()

    def cut(first: Tuple[int, int], last: Tuple[int, int], text: str = "") -> str:
        (l0, c0), (l1, c1) = first, last
        return "\n".join(lines[:l0 - 1] + [lines[l0 - 1][:c0] + text + lines[l1 - 1][c1:]] + lines[l1:]) + "\n"

    def listed(items: List[Any], k: int) -> str:  # item k of an argument list, with its comma
        item = items[k]
        if k + 1 < len(items):
            return cut((item.lineno, item.col_offset), (items[k + 1].lineno, items[k + 1].col_offset))
        if k:
            return cut((items[k - 1].end_lineno, items[k - 1].end_col_offset), (item.end_lineno, item.end_col_offset))
        return cut((item.lineno, item.col_offset), (item.end_lineno, item.end_col_offset))

    data = {name for name, value in known.items() if not callable(value)}
    for node in walk(tree):
        if isinstance(node, ast.BoolOp):  # an operand that no longer decides: `'shard' is not None and hooked`
            neutral = isinstance(node.op, ast.And)
            kept = [v for v in node.values if any(isinstance(n, ast.Name) for n in walk(v))
                    or _case_constant(v, {}, {}, known) is not neutral]
            if kept and len(kept) < len(node.values):
                op = " and " if neutral else " or "
                return cut((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset),
                           op.join(f"({segment(source, v)})" if isinstance(v, ast.BoolOp) and
                                   len(kept) > 1 else segment(source, v) for v in kept))
        if isinstance(node, ast.IfExp) and not any(isinstance(n, ast.Name) for n in walk(node.test)):
            value = _case_constant(node.test, {}, {}, known)
            if value is not None:
                kept = node.body if value else node.orelse
                return cut((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset),
                           segment(source, kept))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            found, value = _known_value(node.value, known)
            field = getattr(value, node.attr, _MISSING) if found else _MISSING
            text = None if field is _MISSING else _literal_text(field)
            if text is not None:
                return cut((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset), text)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 2 \
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).isidentifier():
            obj = segment(source, node.args[0])
            return cut((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset),
                       f"{obj}.{node.args[1].value}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = node.args.posonlyargs + node.args.args
            for k, arg in enumerate(params):
                if arg.arg in data:
                    return listed(params, k)
        if isinstance(node, ast.Call):
            for k, arg in enumerate(node.args):
                if isinstance(arg, ast.Name) and arg.id in data:
                    return listed(node.args, k)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in data:
            return "\n".join(lines[:node.lineno - 1] + lines[node.end_lineno:]) + "\n"
    return None


def _without_dead_code(source: str) -> str:
    """``source`` less the statements after a ``return`` or ``raise`` in the same block (what a branch the case
    takes leaves behind: ``if CASE[...]: return x`` followed by ``return y``)."""
    while True:
        lines = source.splitlines()
        dead = next(((stmts[i + 1].lineno, stmts[-1].end_lineno) for node in walk(parsed(source))
                     for field in ("body", "orelse", "finalbody") for stmts in [getattr(node, field, None)]
                     if isinstance(stmts, list) for i, stmt in enumerate(stmts[:-1])
                     if isinstance(stmt, (ast.Return, ast.Raise))), None)
        if dead is None:
            return source
        source = "\n".join(lines[:dead[0] - 1] + lines[dead[1]:]) + "\n"


def _without_spare_pass(source: str) -> str:
    """``source`` less every ``pass`` of a block that holds other statements (what an ``if`` the case does not take
    leaves behind, :func:`specialised`)."""
    tree = parsed(source)
    spare = {stmt.lineno for node in walk(tree) for field in ("body", "orelse", "finalbody")
             for stmts in [getattr(node, field, None)] if isinstance(stmts, list) and len(stmts) > 1
             for stmt in stmts if isinstance(stmt, ast.Pass)}
    return "\n".join(line for k, line in enumerate(source.splitlines(), 1) if k not in spare) + "\n"


def _dedented(lines: List[str], indent: int) -> List[str]:
    """``lines`` (a block's) moved to ``indent``, from wherever their first line stands."""
    by = (len(lines[0]) - len(lines[0].lstrip())) - indent if lines else 0
    return [line[by:] if line[:by].strip() == "" else line for line in lines]
