"""Where a hook's code lies in its files: the functions and classes of a file, which lines of them run when the
hook runs, the futures' callbacks among them, and a branch's words (the static half of
:mod:`conformance.reports.hook_code`, over Python's own ``ast``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import sys
from typing import Any, List, Sequence, Set, Tuple

__all__ = ["Def", "branch_words", "callbacks", "code_lines", "definitions", "display_path"]

#: The calls whose function argument is a future's callback (run where the future completes).
CALLBACK_METHODS = ("then", "add_done_callback")


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
class Def:
    qualname: str
    start: int
    end: int
    body: int  # the first line of its body
    node: Any
    unit: bool  # a module-level function or a method: what "a function of the hook's that ran" means


@functools.lru_cache(maxsize=64)
def definitions(path: str) -> Tuple[Def, ...]:
    """Every function and class of the file, with its qualified name and lines (decorators included)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ()
    out: List[Def] = []

    def visit(node: ast.AST, prefix: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                is_function = not isinstance(child, ast.ClassDef)
                out.append(Def(name, start, child.end_lineno or child.lineno,
                                child.body[0].lineno if child.body else child.lineno, child,
                                unit=is_function and not in_function))
                visit(child, f"{name}.<locals>." if is_function else f"{name}.", in_function or is_function)
            else:
                visit(child, prefix, in_function)

    visit(tree, "", False)
    return tuple(out)


def code_lines(defs: Sequence[Def], regions: Sequence[Def]) -> Set[int]:
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


def callbacks(path: str, regions: Sequence[Def]) -> List[Def]:
    """The functions defined inside ``regions`` and passed by name to ``Future.then`` / ``add_done_callback``."""
    out = []
    defs = definitions(path)
    for region in regions:
        names = set()
        for node in ast.walk(region.node):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in CALLBACK_METHODS:
                names.update(a.id for a in node.args if isinstance(a, ast.Name))
        for d in defs:
            if d.node is not region.node and region.start <= d.start and d.end <= region.end and \
                    d.qualname.rsplit(".", 1)[-1] in names and not isinstance(d.node, ast.ClassDef):
                out.append(d)
    return out


def branch_words(path: str, line: int, to: int) -> str:
    for node in statements_at(path, line):
        if isinstance(node, (ast.If, ast.While)) and node.body:
            if to == node.body[0].lineno:
                return "never true"
            return "never false"
        if isinstance(node, (ast.For, ast.AsyncFor)) and node.body:
            return "never ran its body" if to == node.body[0].lineno else "never finished the loop"
    return f"never to line {to}" if to > 0 else "never leaves the function from here"


@functools.lru_cache(maxsize=256)
def statements_at(path: str, line: int) -> Tuple[Any, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == line)
