"""A newcomer's first hour, scripted: their own repository, run both ways, then a failure re-run from a clean shell.

The temporary repository is what most ML repositories look like: its own ``models``,
``fixtures`` and ``tests`` packages (names the suite's checkout has too), and a hook
module, ``mytrain/ci.py``, that imports from all three. It holds two DDP hooks: one
that averages as DDP does, and one that sums without averaging. Each run selects the
averaging check alone at world size 2 (two cases), so the file stays cheap.

1. From the repository's root, as README's plug-in section says.
2. From the suite's checkout with only the repository on ``PYTHONPATH``, README's
   nightly form: the checkout's own ``models/``, ``fixtures/`` and ``tests/`` must not
   shadow the user's. The same cases, the same outcomes; the header names every world
   size the run plans, and the run closes with what its counts mean.
3. The re-run command that run 2 printed for its failure, pasted into a shell with no
   venv on ``PATH``, no ``PYTHONPATH`` and no other variable of this one: it re-runs
   that one case, which fails again.

Runs 1 and 2 see no venv on ``PATH`` either, so the command they print is the
interpreter's own (``/path/to/python -m conformance``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.meta_helpers import REPO, read_junit, rerun_command

#: A PATH with no venv on it, as a fresh login shell has.
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
SELECT = ["--hook", "mytrain.ci:SPECS", "--extra-world-size", "0", "-k", "test_ddp_averaging", "-p", "no:randomly"]

FILES = {
    "models/__init__.py": "",
    "models/comm_utils.py": '''
        import torch.distributed as dist


        def mean_factor(process_group):
            return 1.0 / dist.get_world_size(process_group)
    ''',
    "fixtures/__init__.py": "SUM_NAME = 'newcomer_sum'\n",
    "tests/__init__.py": "",
    "tests/helpers.py": '''
        def pg_state(process_group):
            return process_group
    ''',
    "mytrain/__init__.py": "",
    "mytrain/ci.py": '''
        import torch.distributed as dist

        from conformance import HookSpec
        from fixtures import SUM_NAME
        from models.comm_utils import mean_factor
        from tests.helpers import pg_state


        def mean(process_group, bucket):
            tensor = bucket.buffer().mul_(mean_factor(process_group))
            fut = dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])


        def total(process_group, bucket):
            fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])


        SPECS = [HookSpec(name="newcomer_mean", api="ddp", hook=mean, state=pg_state),
                 HookSpec(name=SUM_NAME, api="ddp", hook=total, state=pg_state)]
    ''',
    "conftest.py": "raise RuntimeError('the suite must never load a user repository conftest.py')\n",
}


def clean_env(**extra: str) -> dict:
    """What a fresh shell has: no venv on PATH, no PYTHONPATH, none of this session's variables."""
    env = {"PATH": CLEAN_PATH, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def suite(args, cwd: Path, junit: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "conformance", *args, f"--junitxml={junit}"], cwd=str(cwd),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def myrepo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("myrepo")
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture(scope="module")
def runs(myrepo, tmp_path_factory):
    """Runs 1 and 2, side by side: (exit code, output, cases) of each, and run 2's JSON results."""
    out = tmp_path_factory.mktemp("runs")
    procs = {
        "from_repo": suite(SELECT, myrepo, out / "repo.xml", clean_env()),
        "from_checkout": suite([*SELECT, "--json", str(out / "checkout.json")], Path(REPO), out / "checkout.xml",
                               clean_env(PYTHONPATH=str(myrepo))),
    }
    results = {}
    for key, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        junit = out / ("repo.xml" if key == "from_repo" else "checkout.xml")
        results[key] = (proc.returncode, text, read_junit(str(junit)) if junit.exists() else [])
    results["json"] = json.loads((out / "checkout.json").read_text()) if (out / "checkout.json").exists() else {}
    return results


@pytest.mark.parametrize("where", ["from_repo", "from_checkout"])
def test_the_user_s_packages_load_on_every_rank_and_the_verdicts_are_right(runs, where):
    rc, output, cases = runs[where]
    assert rc == 1, output[-4000:]
    assert sorted((c.hook, c.outcome) for c in cases) == [("newcomer_mean", "passed"), ("newcomer_sum", "failed")]
    assert "newcomer_mean                CONFORMS" in output
    assert "DOES NOT CONFORM (averaging)" in output


def test_the_run_from_the_checkout_names_its_world_sizes_and_says_what_its_counts_mean(runs):
    rc, output, _ = runs["from_checkout"]
    header = next(line for line in output.splitlines() if line.startswith("conformance: torch"))
    assert "world sizes 2 and 4 (4 for test_ddp_parity)" in header, header  # the subgroup config needs 4 ranks
    assert runs["json"]["environment"]["world_sizes"] == [2, 4]
    counts = output.split("what the counts mean", 1)[1]
    assert "1 passed: " in counts and "1 failed: " in counts and "xfailed" not in counts
    assert ("every test of api fsdp, fsdp2, fsdp2_all_reduce and fsdp2_replica (no hook under test has that api)"
            in counts)
    assert "world sizes: the cases ran at 2\n" in counts


def test_the_failure_s_rerun_command_reproduces_it_from_a_clean_shell(runs, myrepo, tmp_path):
    _, _, cases = runs["from_checkout"]
    failed = next(c for c in cases if c.outcome == "failed")
    command = rerun_command(failed.message)
    assert command.startswith(f"PYTHONPATH={shlex.quote(str(myrepo))} {shlex.quote(sys.executable)} -m conformance "
                              "--hook mytrain.ci:SPECS "), command
    junit = tmp_path / "rerun.xml"
    proc = subprocess.run(["/bin/sh", "-c", f"{command} --junitxml={shlex.quote(str(junit))} -p no:randomly"],
                          cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-4000:]
    again = read_junit(str(junit))
    assert [(c.name, c.outcome) for c in again] == [(failed.name, "failed")], proc.stdout[-4000:]
    assert again[0].message.splitlines()[0] == failed.message.splitlines()[0]
