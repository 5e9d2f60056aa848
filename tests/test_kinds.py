"""Every test module has a kind (``tests/kinds.py``), the kinds are pytest's registered markers, and
``tests/conftest.py`` marks each test with its module's kind, or stops the collection where it cannot."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import mark_kinds
from tests.kinds import EXTRAS, KINDS, MODULES

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_every_test_module_has_a_kind_and_every_kind_names_a_module():
    on_disk = {path.stem for path in TESTS.glob("test_*.py")}
    assert sorted(on_disk - set(MODULES)) == [], "add these to tests/kinds.py MODULES"
    assert sorted(set(MODULES) - on_disk) == [], "these are gone: remove them from tests/kinds.py MODULES"


def test_each_module_has_one_kind_first_then_only_extras():
    for name, (kind, *extras) in MODULES.items():
        assert kind in KINDS, name
        assert set(extras) <= set(EXTRAS) and len(set(extras)) == len(extras), name


def test_the_kinds_are_pytests_registered_markers_and_an_unknown_marker_fails():
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = dict(line.split(": ", 1) for line in options["markers"])
    assert registered == {**KINDS, **EXTRAS}
    assert "--strict-markers" in options["addopts"].split()


def test_make_test_fast_runs_the_unit_tests_alone():
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "no test-fast target"
    assert re.search(r"-m pytest tests -m unit\b", recipe.group(1)), recipe.group(1)
    assert re.search(r"^\.PHONY:.*\btest-fast\b", makefile, re.MULTILINE)


class _Item:
    """What :func:`mark_kinds` reads of a collected test: its path, its markers, its fixtures."""

    def __init__(self, module: str, *own: str, fixtures=()):
        self.path = TESTS / f"{module}.py"
        self.nodeid = f"tests/{module}.py::test_x"
        self.fixturenames = list(fixtures)
        self.marks = [SimpleNamespace(name=name) for name in own]

    def iter_markers(self):
        return iter(self.marks)

    def add_marker(self, name: str) -> None:
        self.marks.append(SimpleNamespace(name=name))

    @property
    def names(self):
        return [mark.name for mark in self.marks]


def test_each_test_gets_its_modules_kind_and_extras_unless_it_has_a_kind_of_its_own():
    unit, torchrun, own = _Item("test_compare"), _Item("test_torchrun"), _Item("test_settings", "cli")
    outside = _Item("test_compare")
    outside.path = REPO / "conformance" / "suite" / "test_compare.py"  # the suite's own tests are not ours to mark
    mark_kinds([unit, torchrun, own, outside])
    assert (unit.names, torchrun.names, own.names, outside.names) == (["unit"], ["suite", "torchrun"], ["cli"], [])


def test_a_module_without_a_kind_stops_the_collection():
    with pytest.raises(pytest.UsageError, match="tests/kinds.py names no kind for test_not_in_the_table"):
        mark_kinds([_Item("test_compare"), _Item("test_not_in_the_table")])


def test_a_test_with_two_kinds_stops_the_collection():
    with pytest.raises(pytest.UsageError, match="two kinds: cli, suite"):
        mark_kinds([_Item("test_settings", "suite", "cli")])


@pytest.mark.parametrize("module, own", [("test_compare", ()), ("test_settings", ("cli",)), ("test_zygote", ())])
def test_a_test_that_reads_a_zoo_run_cannot_be_of_a_kind_that_runs_no_suite(module, own):
    with pytest.raises(pytest.UsageError, match="reads a zoo run"):
        mark_kinds([_Item(module, *own, fixtures=["zoo_runs"])])
    item = _Item("test_meta", fixtures=["zoo_runs"])
    mark_kinds([item])
    assert item.names == ["meta"]
