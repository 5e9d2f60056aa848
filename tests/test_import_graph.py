"""The package's modules import one another without a circle, counting function-local imports too.

A circle hidden in a function (``import x`` inside the function that needs it) still
ties the modules together; it only moves the failure to the first call. The API
registry's plan modules, imported with ``importlib`` (``ADAPTERS``), count as imports.
Imports under ``if TYPE_CHECKING:`` do not: they never run.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Installed as subpackages of ``conformance`` from folders outside it (models/, fixtures/, examples/).
OUTSIDE = {"conformance.models", "conformance.fixtures", "conformance.examples"}


def _modules(root: str) -> Dict[str, str]:
    out = {}
    for folder, dirs, files in os.walk(os.path.join(root, "conformance")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, name)
    return out


def _resolve(name: str, mods: Dict[str, str]) -> Optional[str]:
    if ".".join(name.split(".")[:2]) in OUTSIDE:
        return None
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: str, modname: str, mods: Dict[str, str]) -> Set[str]:
    tree = ast.parse(open(path).read())
    found: Set[str] = set()

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            skip = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import) and not skip:
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not skip:
                base = child.module or ""
                if child.level:
                    package = modname.split(".") if path.endswith("__init__.py") else modname.split(".")[:-1]
                    package = package[:len(package) - child.level + 1]
                    base = ".".join(package + ([base] if base else []))
                found.update([base] + [f"{base}.{a.name}" for a in child.names])
            elif (isinstance(child, ast.Constant) and modname == "conformance.apis.registry"
                  and isinstance(child.value, str) and child.value in mods):
                found.add(child.value)  # ADAPTERS: imported with importlib
            visit(child, skip)

    visit(tree, False)
    return {r for r in (_resolve(n, mods) for n in found) if r and r != modname}


def import_cycles(root: str = REPO) -> List[List[str]]:
    """The strongly connected components of more than one module in the package's import graph."""
    mods = _modules(root)
    graph = {m: _imports(p, m, mods) for m, p in mods.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_the_package_has_no_import_circle():
    assert import_cycles() == []


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    """No vacuous pass: a circle closed inside a function, and one through the registry's ADAPTERS, are both found."""
    pkg = tmp_path / "conformance"
    (pkg / "apis").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from conformance import b\n")
    (pkg / "b.py").write_text("def f():\n    from conformance.a import g\n")
    (pkg / "apis" / "__init__.py").write_text("")
    (pkg / "apis" / "registry.py").write_text('ADAPTERS = ("conformance.apis.plan",)\n')
    (pkg / "apis" / "plan.py").write_text("from conformance.apis.registry import ADAPTERS\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from conformance import a\n")
    assert sorted(import_cycles(str(tmp_path))) == [["conformance.a", "conformance.b"],
                                                     ["conformance.apis.plan", "conformance.apis.registry"]]
