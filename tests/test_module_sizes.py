"""The house's size budget (issues 29 and 46): no module of ``conformance/`` over 500 lines, and no module of an
API's folder (``conformance/apis/<api>/``, an API adapter) over 300, so that a newcomer reads any one in minutes.

A module holds one thing, up to 500 lines (the attribution table, say); one that outgrows that is split by what
it does, never to fit a number; docs/layers.md states the budget beside the layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "conformance"

#: The most lines a module may have: an API adapter's, and any other's.
ADAPTER_LINES, MODULE_LINES = 300, 500


def budget(path: Path, package: Path = PACKAGE) -> int:
    """The line budget of ``path``, a module of ``package``: :data:`ADAPTER_LINES` in an API's folder (a folder
    below ``conformance/apis/``), else :data:`MODULE_LINES`."""
    parts = path.relative_to(package).parts
    return ADAPTER_LINES if parts[0] == "apis" and len(parts) > 2 else MODULE_LINES


def lines(path: Path) -> int:
    """Lines of ``path`` as ``wc -l`` counts them (a last line without its newline counts too)."""
    return len(path.read_text(encoding="utf-8").splitlines())


def over_budget(package: Path = PACKAGE) -> Dict[str, str]:
    """``{module: "N lines, budget M"}`` for each module of ``package`` over its budget."""
    return {str(p.relative_to(package.parent)): f"{lines(p)} lines, budget {budget(p, package)}"
            for p in sorted(package.rglob("*.py")) if lines(p) > budget(p, package)}


def test_no_module_is_over_its_line_budget():
    assert over_budget() == {}, "split these modules by what they do (docs/layers.md, 'Size')"


@pytest.mark.parametrize("relative, expected", [
    ("apis/ddp/plan.py", ADAPTER_LINES),
    ("apis/fsdp2_common/standalone.py", ADAPTER_LINES),
    ("apis/__init__.py", MODULE_LINES),
    ("apis/registry.py", MODULE_LINES),
    ("controller/runner.py", MODULE_LINES),
])
def test_an_api_folder_s_modules_have_the_adapter_budget(relative, expected):
    assert (PACKAGE / relative).is_file(), relative
    assert budget(PACKAGE / relative) == expected


def test_a_module_over_its_budget_is_named(tmp_path):
    package = tmp_path / "conformance"
    (package / "apis" / "x").mkdir(parents=True)
    (package / "apis" / "x" / "plan.py").write_text("pass\n" * (ADAPTER_LINES + 1))
    (package / "apis" / "__init__.py").write_text("pass\n" * ADAPTER_LINES + "pass")
    (package / "big.py").write_text("pass\n" * MODULE_LINES)
    assert over_budget(package) == {"conformance/apis/x/plan.py": f"{ADAPTER_LINES + 1} lines, budget 300"}
