"""The package's layers (docs/layers.md) hold: import-linter's contracts in pyproject.toml, checked here.

``lint-imports`` reads ``[tool.importlinter]`` in pyproject.toml: the layers contract (the entry points
on top, the controller beside the rank side, reproducers and reports, the shared modules, the APIs' controller
side, the spec, the API registry, the foundation), the API folders' three forbidden contracts, the one that keeps
the controller's side off the rank side (``controller-off-ranks``), and ``acyclic_siblings``, which
finds a circle between the children of any package under ``conformance``. Every import statement
counts, function-local ones too; imports under ``if TYPE_CHECKING:`` do not (they never run).

A circle across the top-level parts cannot pass either: the layers contract forbids one direction between
any two layers, and the forbidden contracts close the API folders' ways back (an API's folder never imports
the controller's side, nothing below the entry points imports an API's folder but by name through the
registry or through its controller side's imports, what the registry loads by name imports nothing above it, and
nothing the controller's side imports, an API's controller side included, imports the rank side).

The contracts are run on a copy of the package with an inverted import added, so a pass is never vacuous.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Set

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


def _lint_with(tmp_path: Path, module: str, code: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on a copy of the package (under ``tmp_path``) whose ``module`` (a path under
    ``conformance/``) ends with ``code``."""
    root = _copy(tmp_path)
    with open(root / "conformance" / module, "a") as f:
        f.write(code)
    return _lint(root, REPO / "pyproject.toml")


def test_the_import_contracts_hold():
    result = _lint(REPO, REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout)
    assert kept, result.stdout
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert int(kept.group(1)) == len(config["contracts"]), result.stdout


def test_an_inverted_import_inside_a_function_breaks_the_layers(tmp_path):
    """The rank side importing the controller, even inside a function, breaks the layers contract."""
    result = _lint_with(tmp_path, "ranks/zygote.py",
                        "\n\ndef _inverted():\n    from conformance.controller import runner  # noqa: F401\n")
    assert result.returncode == 1, result.stdout
    assert "conformance.ranks is not allowed to import conformance.controller" in result.stdout, result.stdout


def test_a_plan_that_imports_the_rank_side_is_caught(tmp_path):
    """The registry loads the plans by name (no import the layers contract sees); their own contract holds them."""
    result = _lint_with(tmp_path, "apis/fsdp/plan.py",
                        "\n\ndef _up():\n    from conformance.ranks.checks import common  # noqa: F401\n")
    assert result.returncode == 1, result.stdout
    assert "conformance.apis.fsdp.plan is not allowed to import conformance.ranks" in result.stdout, result.stdout


def test_a_circle_inside_a_part_is_caught(tmp_path):
    result = _lint_with(tmp_path, "controller/options.py",
                        "\n\ndef _circle():\n    from conformance.controller import cli  # noqa: F401\n")
    assert result.returncode == 1, result.stdout
    assert "No cycles are allowed in conformance.controller" in result.stdout, result.stdout
    assert ".options -> .cli" in result.stdout, result.stdout


def test_a_type_checking_import_does_not_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` never runs, so it may name a higher layer (for annotations)."""
    result = _lint_with(tmp_path, "shared/rank_log.py",
                        "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from conformance.controller.runner import Runner  # noqa: F401\n")
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


def test_a_builtin_hooks_module_that_imports_the_rank_side_is_caught(tmp_path):
    """An API's built-in hooks reach the controller through ``conformance.apis.controller_side`` (the default-hook
    replay): one that imports rank code, even inside a function, breaks ``controller-off-ranks``."""
    result = _lint_with(tmp_path, "apis/ddp/builtin_hooks.py",
                        "\n\ndef _rank_side():\n    from conformance.ranks.checks import common  # noqa: F401\n")
    assert result.returncode == 1, result.stdout
    assert re.search(r"The controller's side never imports the rank side.*\n.*BROKEN", result.stdout), result.stdout
    assert "conformance.apis.controller_side is not allowed to import conformance.ranks" in result.stdout, \
        result.stdout


def test_the_controller_side_reaches_only_an_api_s_builtin_hooks_and_standalone_part(tmp_path):
    """``apis-by-name`` lets ``conformance.apis.controller_side`` import an API's ``builtin_hooks`` and standalone
    modules, and nothing else of its folder: the controller reaching an API's other modules through it is caught."""
    result = _lint_with(tmp_path, "apis/controller_side.py",
                        "\n\ndef _more():\n    from conformance.apis.ddp import native_modes  # noqa: F401\n")
    assert result.returncode == 1, result.stdout
    assert "conformance.apis.controller_side -> conformance.apis.ddp.native_modes" in result.stdout, result.stdout


def _directly_imported_by(module: str) -> Set[str]:
    """The modules ``module`` imports, as import-linter's graph has them (``if TYPE_CHECKING:`` imports left out)."""
    import grimp  # import-linter's graph, installed with it

    graph = grimp.build_graph("conformance", cache_dir=None, exclude_type_checking_imports=True)
    return set(graph.find_modules_directly_imported_by(module))


def test_every_module_an_api_names_for_the_controller_side_is_imported_where_the_linter_sees_it():
    """Every API of the registry has a controller side, and each of its modules (the module of its
    ``HookApi.builtin_hooks`` target, where its default hook lives, its standalone part) is one that
    ``conformance.apis.controller_side`` imports: an API cannot hand the controller a module by name that
    ``controller-off-ranks`` never sees."""
    from conformance.apis.controller_side import SIDES, controller_side
    from conformance.apis.registry import HOOK_APIS

    assert list(SIDES) == list(HOOK_APIS), "conformance/apis/controller_side.py's SIDES lists every API, in order"
    imported = _directly_imported_by("conformance.apis.controller_side")
    for name, api in HOOK_APIS.items():
        side = controller_side(name)
        target = api.builtin_hooks.partition(":")[0] if api.builtin_hooks else None
        assert (side.builtin_hooks.__name__ if side.builtin_hooks else None) == target, (name, target)
        if side.default_hook is not None:
            assert side.builtin_hooks is not None and side.default_hook.__module__ == target, name
        assert side.standalone, f"{name}: no standalone part, so no reproducers"
        missing = [m.__name__ for m in side.modules if m.__name__ not in imported]
        assert not missing, f"{name}: {missing} reached otherwise than by an import in controller_side.py"


def test_an_unknown_api_has_no_controller_side():
    from conformance.apis.controller_side import controller_side

    with pytest.raises(KeyError, match="no_such_api.*known: fsdp, ddp"):
        controller_side("no_such_api")


#: A child interpreter: the controller, the reports and the reproducers imported whole, then every API's controller
#: side (its built-in hooks and default hook, its standalone part).
_CONTROLLER_SIDE = """
import importlib, pkgutil, sys
import conformance.controller, conformance.reports, conformance.reproducers
for pkg in (conformance.controller, conformance.reports, conformance.reproducers):
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
from conformance.apis.controller_side import SIDES, controller_side
for api in SIDES:
    controller_side(api)
    ranks = sorted(n for n in sys.modules if n.startswith("conformance.ranks"))
    if ranks:
        sys.exit(f"{api}'s controller side imports the rank side: {', '.join(ranks[:4])}")
"""


@pytest.mark.cli
def test_the_controller_imports_no_rank_code_even_through_an_api_s_controller_side():
    """``controller-off-ranks`` as the interpreter sees it: an import by name inside an API's built-in hooks or
    standalone part would escape the linter (DDP's default hook once lived beside compiled DDP's recorder, so
    resolving it pulled ``conformance.ranks.checks`` into the controller)."""
    proc = subprocess.run([sys.executable, "-c", _CONTROLLER_SIDE], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
