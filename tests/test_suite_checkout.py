"""A checkout of the suite on sys.path never shadows a user's ``models``, ``fixtures``, ``examples`` or ``tests``.

Each test builds a fake suite checkout (``conformance/spec.py`` beside
``models/``, ``fixtures/``, ``examples/`` and ``tests/``) and a user's repository
with packages of the same names, each package recording whose it is, then
imports them in this process with the guard installed. ``sys.path``,
``sys.meta_path`` and those entries of ``sys.modules`` are restored afterwards.
The whole run, started from either directory, is ``tests/test_newcomer.py``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

from conformance.shared import suite_checkout
from conformance.shared.spec_loading import user_paths_first

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
NAMES = ("models", "fixtures", "examples", "tests")


def _package(root: Path, name: str, owner: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(f"OWNER = {owner!r}\n")


@pytest.fixture
def checkout(tmp_path) -> Path:
    root = tmp_path / "suite"
    (root / "conformance").mkdir(parents=True)
    (root / "conformance" / "spec.py").write_text("")
    for name in NAMES:
        _package(root, name, "suite")
    return root


@pytest.fixture
def user_repo(tmp_path) -> Path:
    root = tmp_path / "user"
    for name in NAMES:
        _package(root, name, "user")
    return root


@pytest.fixture
def isolated(monkeypatch):
    """Import state restored after the test; the guard installed; no cached ``models``/``fixtures``/..."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in NAMES}
    for key in saved:
        del sys.modules[key]
    yield
    for key in [k for k in sys.modules if k.split(".")[0] in NAMES]:
        del sys.modules[key]
    sys.modules.update(saved)
    importlib.invalidate_caches()


def _import_owner(name: str) -> str:
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return importlib.import_module(name).OWNER


def test_the_suite_folders_are_the_ones_pyproject_installs_under_conformance():
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {f"conformance.{name}": name for name in suite_checkout.SUITE_FOLDERS} == package_dir


def test_a_checkout_is_recognised_by_its_conformance_source_beside_a_suite_folder(checkout, user_repo):
    assert suite_checkout.is_suite_checkout(str(checkout))
    assert suite_checkout.is_suite_checkout(str(REPO))
    assert not suite_checkout.is_suite_checkout(str(user_repo))
    assert not suite_checkout.is_suite_checkout("")


def test_a_checkout_goes_after_the_other_user_entries(checkout, user_repo, tmp_path):
    other = str(tmp_path / "other")
    assert suite_checkout.order_user_paths([str(checkout), str(user_repo), other, str(user_repo)]) == [
        str(user_repo), other, str(checkout)]


def test_from_the_checkout_with_the_user_repo_on_pythonpath_every_user_package_wins(
        checkout, user_repo, isolated, monkeypatch):
    """The issue's nightly form: ``PYTHONPATH=~/myrepo make conform`` run in the suite's checkout."""
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("PYTHONPATH", str(user_repo))
    path = user_paths_first()
    assert path[:2] == (str(user_repo), str(checkout))
    assert {name: _import_owner(name) for name in NAMES} == dict.fromkeys(NAMES, "user")


def test_from_the_user_repo_with_the_checkout_on_pythonpath_the_user_packages_win(
        checkout, user_repo, isolated, monkeypatch):
    monkeypatch.chdir(user_repo)
    monkeypatch.setenv("PYTHONPATH", str(checkout))
    user_paths_first()
    assert {name: _import_owner(name) for name in NAMES} == dict.fromkeys(NAMES, "user")


def test_an_installed_user_package_wins_over_the_checkout_in_front_of_it(checkout, user_repo, isolated):
    """A setuptools editable install of a flat-layout repository adds a finder at the end of sys.meta_path,
    after the path finder that scans the checkout: the guard still finds the user's ``models``."""

    class EditableFinder:  # as setuptools' __editable___*_finder.py: a mapping, appended to sys.meta_path
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            if path is None and fullname in ("models", "fixtures"):
                return importlib.util.spec_from_file_location(
                    fullname, str(user_repo / fullname / "__init__.py"),
                    submodule_search_locations=[str(user_repo / fullname)])
            return None

    sys.path.insert(0, str(checkout))
    sys.meta_path.append(EditableFinder)
    suite_checkout.install()
    assert _import_owner("models") == "user" and _import_owner("fixtures") == "user"


def test_with_no_user_package_the_checkout_folder_is_still_not_a_top_level_package(checkout, isolated):
    sys.path.insert(0, str(checkout))
    suite_checkout.install()
    with pytest.raises(ModuleNotFoundError) as info:
        _import_owner("models")
    assert "conformance.models" in str(info.value) and str(checkout / "models") in str(info.value)
    assert info.value.name == "models"
    assert _import_owner("tests") == "suite", "the checkout's other folders stay importable (tests.zoo)"


def test_the_guard_leaves_every_other_name_and_every_submodule_to_the_usual_finders(checkout):
    assert suite_checkout.CheckoutGuard.find_spec("numpy") is None
    assert suite_checkout.CheckoutGuard.find_spec("models.net", [str(checkout / "models")]) is None


def test_installing_the_guard_twice_puts_it_first_once(isolated):
    suite_checkout.install()
    suite_checkout.install()
    assert sys.meta_path[0] is suite_checkout.CheckoutGuard
    assert sys.meta_path.count(suite_checkout.CheckoutGuard) == 1
