"""pyproject.toml installs every package of the source tree, and the data files its code reads.

setuptools installs only the packages listed in ``[tool.setuptools] packages``: a subpackage left out
works in the editable install of a checkout and is missing from a wheel (it happened with
``conformance.adapters``). This holds the list to the tree.
"""

from __future__ import annotations

import os
import sys

from tests.meta_helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _setuptools():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_of_the_source_tree_is_installed():
    listed = set(_setuptools()["packages"])
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, "conformance")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            found.add(os.path.relpath(dirpath, REPO).replace(os.sep, "."))
    mapped = set(_setuptools()["package-dir"])
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert listed - found - mapped == set(), "pyproject.toml lists packages that do not exist"


def test_the_data_files_the_code_reads_are_package_data():
    data = _setuptools()["package-data"]
    assert "results.schema.json" in data["conformance.reports"]
    assert os.path.exists(os.path.join(REPO, "conformance", "reports", "results.schema.json"))
    assert "pytest.ini" in data["conformance.suite"]
