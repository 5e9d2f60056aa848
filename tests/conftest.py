"""Fixtures shared by the project's tests.

``zoo_runs``: each meta-run (``tests/meta_zoos.py``) once per pytest session, on first use, shared by
every test that needs it, whatever its file: a zoo run costs minutes on a 2-core machine.
"""

from __future__ import annotations

import pytest

from tests.meta_helpers import ZooRuns


@pytest.fixture(scope="session")
def zoo_runs(tmp_path_factory) -> ZooRuns:
    """``zoo_runs(zoo)``: the :class:`~tests.meta_helpers.SuiteRun` of a :class:`~tests.meta_helpers.MetaZoo`."""
    return ZooRuns(tmp_path_factory)
