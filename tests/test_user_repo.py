"""The suite run from a user's own repository, as ``conform --hook ...`` from its root.

The temporary repository holds its own ``models``, ``fixtures`` and ``tests``
packages (names most ML repositories use) and a ``conftest.py`` that must never
be loaded. Its hook module imports from those packages, on the controller and
inside every rank. The suite's modules live under ``conformance`` and must
neither shadow the user's packages nor be shadowed by them.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.meta_helpers import run_suite

HOOKS = '''
    import os
    import __main__

    import torch.distributed as dist

    from conformance import HookSpec
    from conformance.models import MODELS as SUITE_MODELS  # the suite's models, not the user's
    from fixtures import SCALE
    from models.mything import X

    assert "analytic_linear" in SUITE_MODELS and X == 42 and SCALE == 1.0


    def allreduce_mean(process_group, bucket):
        tensor = bucket.buffer().mul_(SCALE / dist.get_world_size(process_group))
        fut = dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


    def pg_state(process_group):
        return process_group


    SPECS = [
        HookSpec(name="user_repo_mean", api="ddp", hook=allreduce_mean, state=pg_state),
        HookSpec(name="user_repo_needs_a_package", api="ddp", hook=allreduce_mean, state=pg_state,
                 requires=("no_such_package_for_conformance",)),
    ]
'''

RANK_ONLY_FAILURE = '''
    import os

    from tests.my_hooks import SPECS

    if "CONFORM_RANK" in os.environ:  # set in every rank process, never in the controller
        raise ImportError("simulated: a CUDA extension that only the rank processes fail to load")
    SPEC = SPECS[0]
'''

PID_NAMED = '''
    import os

    from conformance import HookSpec
    from tests.my_hooks import allreduce_mean, pg_state

    SPEC = HookSpec(name=f"hook_{os.getpid()}", api="ddp", hook=allreduce_mean, state=pg_state)
'''


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user_repo")
    files = {
        "models/__init__.py": "MODELS = {'mine': 1}\n",
        "models/mything.py": "X = 42\n",
        "fixtures/__init__.py": "SCALE = 1.0\n",
        "fixtures/known_failures.toml": "this is not TOML, and the suite must not read it\n",
        "tests/__init__.py": "",
        "tests/my_hooks.py": HOOKS,
        "tests/rank_only_failure.py": RANK_ONLY_FAILURE,
        "tests/pid_named.py": PID_NAMED,
        "conftest.py": "raise RuntimeError('the user repository conftest.py must not be loaded by the suite')\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def run_in(user_repo: Path, tmp_path: Path, *args: str):
    return run_suite(list(args), str(tmp_path / "report.xml"), cwd=str(user_repo), timeout=300)


@pytest.fixture(scope="module")
def specs_run(user_repo, tmp_path_factory):
    """One run of the user's two specs, read by the two tests below: the hook that loads from the user's
    ``tests`` package and runs, and the one whose package is missing, skipped with the package named."""
    return run_in(user_repo, tmp_path_factory.mktemp("specs"), "--hook", "tests.my_hooks:SPECS",
                  "--extra-world-size", "0", "-rs", "-k", "test_ddp_averaging or (test_ddp_parity and static_graph)")


def test_hook_in_a_user_tests_package_loads_and_runs_on_every_rank(specs_run):
    run = specs_run
    assert run.returncode == 0, run.output[-4000:]
    mine = [c for c in run.cases if c.hook == "user_repo_mean"]
    assert {c.check for c in mine} == {"averaging", "parity"}
    assert all(c.outcome == "passed" for c in mine), [(c.name, c.outcome, c.message[:500]) for c in mine]
    assert "user_repo_mean" in run.output and "CONFORMS" in run.output


def test_a_hook_whose_package_is_missing_is_skipped_with_the_package_named(specs_run):
    run = specs_run
    assert run.returncode == 0, run.output[-4000:]
    # By test id: a case skipped when planned carries no JUnit properties (no hook property).
    needs = [c for c in run.cases if "[user_repo_needs_a_package-" in c.name]
    assert needs and all(c.outcome == "skipped" for c in needs)
    assert all("no_such_package_for_conformance" in c.message and "pip install" in c.message for c in needs)
    line = next(ln for ln in run.output.splitlines() if ln.startswith("user_repo_needs_a_package"))
    assert "NOT RUN: every case was skipped" in line and "CONFORMS" not in line
    assert (f"skipped ({len(needs)}): hook user_repo_needs_a_package needs no_such_package_for_conformance"
            in run.output), run.output[-4000:]


def test_a_spec_that_fails_only_inside_the_ranks_is_a_usage_error_naming_the_rank(user_repo, tmp_path):
    run = run_in(user_repo, tmp_path, "--hook", "tests.rank_only_failure:SPEC", "--extra-world-size", "0",
                 "-k", "test_ddp_averaging")
    assert run.returncode == 4, run.output[-4000:]
    assert "simulated: a CUDA extension" in run.output and re.search(r"rank \d of the gloo/cpu pool", run.output)
    assert "tests/rank_only_failure.py\", line" in run.output  # the rank's own traceback
    assert "no hook is blamed" in run.output
    assert not [c for c in run.cases if c.outcome == "failed"], "a hook was blamed for a usage error"


def test_a_spec_named_differently_in_each_process_is_a_usage_error(user_repo, tmp_path):
    run = run_in(user_repo, tmp_path, "--hook", "tests.pid_named:SPEC", "--extra-world-size", "0",
                 "-k", "test_ddp_averaging")
    assert run.returncode == 4, run.output[-4000:]
    assert "has no spec named 'hook_" in run.output and "same spec names in every process" in run.output


def test_a_run_only_at_world_size_one_never_says_conforms(user_repo, tmp_path):
    run = run_in(user_repo, tmp_path, "--hook", "tests.my_hooks:SPECS", "--world-size", "1",
                 "--extra-world-size", "0", "-k", "test_ddp_parity and static_graph")
    assert run.cases and all(c.outcome == "passed" for c in run.cases if c.hook == "user_repo_mean")
    assert run.returncode == 1, run.output[-4000:]
    line = next(ln for ln in run.output.splitlines() if ln.startswith("user_repo_mean"))
    assert "NOT CHECKED ACROSS RANKS" in line and "CONFORMS" not in line
    assert "ran only at world size 1" in run.output
