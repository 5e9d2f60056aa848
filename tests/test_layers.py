"""The package's layers (docs/layers.md) hold: import-linter's contracts in pyproject.toml, checked here.

``lint-imports`` reads ``[tool.importlinter]`` in pyproject.toml: the layers contract (the entry points
on top, the controller beside the rank side, reproducers and reports, the shared modules, the spec, the
API registry, the foundation), the API folders' two forbidden contracts, and ``acyclic_siblings``, which
finds a circle between the children of any package under ``conformance``. Every import statement
counts, function-local ones too; imports under ``if TYPE_CHECKING:`` do not (they never run).

A circle across the top-level parts cannot pass either: the layers contract forbids one direction between
any two layers, and the forbidden contracts close the API folders' ways back (an API's folder never imports
the controller's side, nothing below the entry points imports an API's folder but by name through the
registry, and what the registry loads by name imports nothing above it).

The contracts are run on a copy of the package with an inverted import added, so a pass is never vacuous.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

if sys.version_info < (3, 11):
    import tomli as tomllib
else:
    import tomllib

REPO = Path(__file__).resolve().parents[1]

if sys.version_info < (3, 10):
    pytest.skip("import-linter 2.13+ (its acyclic_siblings contract) needs Python 3.10 or newer",
                allow_module_level=True)
import importlinter  # noqa: E402,F401 - the `test` extra, installed by `make setup`


def _lint(package_root: Path, config: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``conformance`` package under ``package_root``, with ``config``'s contracts."""
    env = dict(os.environ, PYTHONPATH=str(package_root))
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                           "--config", str(config), "--no-cache"],
                          cwd=str(package_root), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    """The package's modules (``conformance/``, Python files only) under ``tmp_path``."""
    shutil.copytree(REPO / "conformance", tmp_path / "conformance",
                    ignore=lambda folder, names: [n for n in names if n == "__pycache__"
                                                  or (os.path.isfile(os.path.join(folder, n))
                                                      and not n.endswith(".py"))])
    return tmp_path


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_the_import_contracts_hold():
    result = _lint(REPO, REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout
    assert re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout), result.stdout


def test_an_inverted_import_inside_a_function_breaks_the_layers(tmp_path):
    """The rank side importing the controller, even inside a function, breaks the layers contract."""
    root = _copy(tmp_path)
    _append(root / "conformance" / "ranks" / "zygote.py",
            "\n\ndef _inverted():\n    from conformance.controller import runner  # noqa: F401\n")
    result = _lint(root, REPO / "pyproject.toml")
    assert result.returncode == 1, result.stdout
    assert "conformance.ranks is not allowed to import conformance.controller" in result.stdout, result.stdout


def test_a_plan_that_imports_the_rank_side_is_caught(tmp_path):
    """The registry loads the plans by name (no import the layers contract sees); their own contract holds them."""
    root = _copy(tmp_path)
    _append(root / "conformance" / "apis" / "fsdp" / "plan.py",
            "\n\ndef _up():\n    from conformance.ranks.checks import common  # noqa: F401\n")
    result = _lint(root, REPO / "pyproject.toml")
    assert result.returncode == 1, result.stdout
    assert "conformance.apis.fsdp.plan is not allowed to import conformance.ranks" in result.stdout, result.stdout


def test_a_circle_inside_a_part_is_caught(tmp_path):
    root = _copy(tmp_path)
    _append(root / "conformance" / "controller" / "options.py",
            "\n\ndef _circle():\n    from conformance.controller import cli  # noqa: F401\n")
    result = _lint(root, REPO / "pyproject.toml")
    assert result.returncode == 1, result.stdout
    assert "No cycles are allowed in conformance.controller" in result.stdout, result.stdout
    assert ".options -> .cli" in result.stdout, result.stdout


def test_a_type_checking_import_does_not_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` never runs, so it may name a higher layer (for annotations)."""
    root = _copy(tmp_path)
    _append(root / "conformance" / "shared" / "rank_log.py",
            "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from conformance.controller.runner import Runner  # noqa: F401\n")
    result = _lint(root, REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout


def _layers() -> List[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return contract["layers"]


def test_docs_layers_states_the_contracts_order():
    """docs/layers.md lists the layers of the contract, top to bottom, each with its modules."""
    text = (REPO / "docs" / "layers.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == len(_layers()), rows
    for row, layer in zip(rows, _layers()):
        for name in re.split(r"[|:]", layer):
            assert f"`{name.strip()}`" in row, (name, row)


def test_every_api_folder_is_reached_only_by_name():
    """The ``apis-by-name`` contract lists its folders by hand: a new API folder (or a shared one, as
    ``fsdp2_common``) left out of it could be imported from the controller unseen."""
    config = tomllib.loads((Path(REPO) / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "apis-by-name")
    folders = {f"conformance.apis.{p.name}" for p in (Path(REPO) / "conformance" / "apis").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders and set(contract["forbidden_modules"]) == folders


#: A child interpreter: the controller and reports imported whole, then every part an API names by ``module:ATTR``
#: that the controller resolves (its default hook, its built-in specs, its reproducers' standalone modules).
_CONTROLLER_BY_NAME = """
import importlib, pkgutil, sys
import conformance.controller, conformance.reports
for pkg in (conformance.controller, conformance.reports):
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
from conformance.apis.registry import HOOK_APIS
for api in HOOK_APIS.values():
    for target in (api.default_hook, api.builtin_hooks, *api.standalone_modules):
        if target:
            importlib.import_module(target.split(":")[0])
            ranks = sorted(n for n in sys.modules if n.startswith("conformance.ranks"))
            if ranks:
                sys.exit(f"{api.name}: {target} imports the rank side: {', '.join(ranks[:4])}")
"""


@pytest.mark.cli
def test_the_controller_imports_no_rank_code_even_through_an_api_s_names():
    """import-linter cannot see an import by name: the contract that keeps the controller off the rank side holds
    for what the registry names too (DDP's default hook once lived beside compiled DDP's recorder, so resolving it
    pulled ``conformance.ranks.checks`` into the controller)."""
    proc = subprocess.run([sys.executable, "-c", _CONTROLLER_BY_NAME], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
