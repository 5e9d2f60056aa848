"""Redundancy at 3 ranks: every rounding-order and shard-order bug of the zoos is caught by two cases.

One run of the suite over ``tests/zoo/order_bugs.py`` at its default world sizes (2 and 3),
restricted to the cases at 3 ranks. For each bug, at least two failed cases must differ in
what they exercise (check, variant or model): one case alone is one refactor away from
letting such a hook through.
"""

from __future__ import annotations

import os
from typing import Dict

import pytest

from tests.meta_helpers import BackgroundJob, SuiteRun, run_suite
from tests.zoo import order_bugs


def _order_run(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    return run_suite(["--hook", "tests.zoo.order_bugs:ORDER_BUGS", "-q", "-k", "ws3"],
                     os.path.join(directory, "order.xml"), env=env)


#: The run, in the zoo runs' background threads (``tests/conftest.py``).
ORDER_RUN = BackgroundJob("order_bugs", _order_run)


@pytest.fixture(scope="module")
def run_at_three(zoo_runs):
    run = zoo_runs(ORDER_RUN)
    assert run.cases, f"the suite wrote no JUnit cases; output:\n{run.output[-4000:]}"
    return run


def test_every_class_is_in_the_run():
    assert {s.name for s in order_bugs.ORDER_BUGS} == {f"{api}_{name}" for api, names in order_bugs.CLASSES.items()
                                                      for name in names}


@pytest.mark.parametrize("name", sorted(s.name for s in order_bugs.ORDER_BUGS))
def test_caught_twice_at_three_ranks(run_at_three, name):
    failed = [c for c in run_at_three.by_hook()[name] if c.outcome == "failed"]
    independent = {(c.check, c.properties.get("variant"), c.properties.get("model")) for c in failed}
    assert len(independent) >= 2, f"{name} is caught at 3 ranks only by {sorted(independent)}"
