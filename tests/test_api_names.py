"""Adding a hook API is one folder: no module of the package outside ``conformance/apis/<api>/`` names an API.

The manual's "Adding a hook API" (docs/architecture.md) says which files a new API touches; this holds
the rest of the package to it. A module names an API when its code (not its
prose) has:

* a string that is an API's name (``"fsdp2"``), as in ``if api == "fsdp2":``;
* an import of ``conformance.apis.<api>`` (``from conformance.apis.ddp import ...``);
* a string that is such a module path or target (``"conformance.apis.ddp.models:DdpModels"``);
* a string that is one of an API's rank checks (``"fsdp.clip_grad_norm"``).

Allowed: the registry's ``ADAPTERS`` (the one list of the API plan modules); the controller side's ``SIDES``
and its loaders' imports (``conformance/apis/controller_side.py``, the one module that imports each API's
built-in hooks and standalone part, so import-linter sees those imports); and
what :data:`ALLOWED` lists with its reason. Outside the package, hooks and their
tests name their API by design (``examples/``, ``tests/zoo/``, the known-failures
file, the docs).
"""

from __future__ import annotations

import ast
import os
import re
from typing import Iterator, List, Tuple

import pytest

from conformance.apis.registry import HOOK_APIS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_FOLDERS = sorted(name for name in os.listdir(os.path.join(REPO, "conformance", "apis"))
                     if os.path.isfile(os.path.join(REPO, "conformance", "apis", name, "__init__.py")))
API_NAMES = sorted(HOOK_APIS)

#: ``(path, the string it may hold) -> why``: what may name an API outside its folder.
ALLOWED = {
    ("conformance/controller/default_replay.py", "fsdp.clip_grad_norm"):
        "the torch < 2.5 reference caveat of FSDP1's clip_grad_norm_ (ReferenceCaveat.checks) lives with the "
        "controller's replay rules; moving the caveats into the API folders is the controller half's to do",
}


def _modules() -> List[str]:
    """Every Python module of the package outside the API folders, and of ``models/``, relative to the repo."""
    out = []
    for top in ("conformance", "models"):
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            rel = os.path.relpath(root, REPO)
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(rel, d) not in
                       {os.path.join("conformance", "apis", a) for a in API_FOLDERS}]
            out += [os.path.join(rel, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _api_module(name: str) -> bool:
    """Whether ``name`` (a module, or a ``module:ATTR`` target) is inside an API's folder."""
    return any(re.match(rf"conformance\.apis\.{a}(\.|:|$)", name) for a in API_FOLDERS)


def _rank_check(text: str) -> bool:
    return any(re.fullmatch(rf"{re.escape(a)}\.[a-z_]+", text) for a in API_NAMES)


#: The modules that list every API, each with the module-level name of its list: ``(path, name) -> whether the
#: module may also import API folders`` (the controller side's loaders do; the registry loads by name).
INDEXES = {
    (os.path.join("conformance", "apis", "registry.py"), "ADAPTERS"): False,
    (os.path.join("conformance", "apis", "controller_side.py"), "SIDES"): True,
}


def _listed(tree: ast.Module, name: str) -> List[ast.AST]:
    """The nodes of ``name: ... = ...`` (the index's list of the APIs): allowed."""
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return list(ast.walk(node.value))
    return []


def names_of_apis(path: str, source: str) -> Iterator[Tuple[int, str]]:
    """``(line, what)`` for each place in ``source`` that names an API."""
    tree = ast.parse(source, path)
    allowed: set = set()
    imports_allowed = False
    for (index, name), imports in INDEXES.items():
        if path == index:
            allowed, imports_allowed = set(map(id, _listed(tree, name))), imports
    for node in ast.walk(tree):
        if imports_allowed and isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _api_module(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _api_module(node.module):
                yield node.lineno, f"from {node.module} import ..."
            elif node.module == "conformance.apis":
                for alias in node.names:
                    if alias.name in API_FOLDERS:
                        yield node.lineno, f"from conformance.apis import {alias.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed:
            text = node.value
            if (text in API_NAMES or _api_module(text) or _rank_check(text)) and \
                    (path.replace(os.sep, "/"), text) not in ALLOWED:
                yield node.lineno, repr(text)


def test_the_check_sees_each_way_of_naming_an_api():
    """The scan is not vacuous: each form it looks for is found in a module written to have it."""
    source = ('import conformance.apis.ddp.models\nfrom conformance.apis.fsdp import plan\n'
              'from conformance.apis import fsdp2\nif api == "fsdp2_all_reduce": pass\n'
              'TARGET = "conformance.apis.ddp.models:DdpModels"\nCHECK = "fsdp.parity"\n'
              '"""A docstring about fsdp2 comms is prose."""\n')
    found = [what for _, what in sorted(names_of_apis("conformance/x.py", source))]
    assert found == ["import conformance.apis.ddp.models", "from conformance.apis.fsdp import ...",
                     "from conformance.apis import fsdp2", "'fsdp2_all_reduce'",
                     "'conformance.apis.ddp.models:DdpModels'", "'fsdp.parity'"]


@pytest.mark.parametrize("path", _modules())
def test_no_module_outside_an_apis_folder_names_an_api(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        found = list(names_of_apis(path, f.read()))
    assert not found, (f"{path} names a hook API ({'; '.join(f'line {n}: {w}' for n, w in found)}): what an API "
                       "needs belongs in its folder, conformance/apis/<api>/, reached through its HookApi "
                       "(docs/architecture.md, 'Adding a hook API')")


def test_every_allowed_exception_is_still_needed():
    """An entry of ALLOWED that nothing needs any more is removed, so the list never rots."""
    for path, text in ALLOWED:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            source = f.read()
        assert f'"{text}"' in source or f"'{text}'" in source, (path, text)


def test_the_scan_covers_the_controller_the_ranks_and_every_module_outside_the_api_folders():
    """Every module of ``controller/`` and ``ranks/`` (new ones too) is scanned; no API folder's is."""
    scanned = set(_modules())
    for part in ("controller", "ranks"):
        for root, dirs, files in os.walk(os.path.join(REPO, "conformance", part)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            missing = [f for f in files if f.endswith(".py") and os.path.relpath(os.path.join(root, f), REPO)
                       not in scanned]
            assert not missing, (root, missing)
    assert any(p.startswith(os.path.join("conformance", "controller", "")) for p in scanned)
    assert any(p.startswith(os.path.join("conformance", "ranks", "checks", "")) for p in scanned)
    assert not [p for p in scanned if _api_module(p[:-3].replace(os.sep, "."))]
