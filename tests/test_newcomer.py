"""A newcomer's first hour, scripted: their own repository, run both ways, a failure re-run and reproduced from a
clean shell, then README's nightly recipe.

The temporary repository is what most ML repositories look like: its own ``models``,
``fixtures`` and ``tests`` packages (names the suite's checkout has too), laid out as
README's plug-in section says: the hooks in ``mytrain/hooks.py`` (torch and the user's
own code), their specs in ``mytrain/ci.py``, which imports from all three. It holds two
DDP hooks: one that averages as DDP does, and one that sums without averaging. Each run
selects the averaging check alone at world size 2 (two cases), so the file stays cheap.

1. From the repository's root, as README's plug-in section says, with
   ``--write-reproducers``: the failed case gets a reproducer, the passing one none.
2. From the suite's checkout with only the repository on ``PYTHONPATH``: the checkout's
   own ``models/``, ``fixtures/`` and ``tests/`` must not shadow the user's. The same
   cases, the same outcomes; the header names every world size the run plans, and the run
   closes with what its counts mean.
3. The re-run command that run 2 printed for its failure, pasted into a shell with no
   venv on ``PATH``, no ``PYTHONPATH`` and no other variable of this one: it re-runs
   that one case, which fails again.
4. The reproducer command that run 1 printed, pasted into such a shell at the
   repository's root, where ``conformance`` cannot be imported: it reproduces (exit 1).
   Pasted in another directory, it cannot import the hook's module: exit 2, naming it.
5. README's nightly recipe (the ``run:`` of its conformance step, as written, with
   README's example specs for ``my_pkg.specs:SPECS``) in a fresh workspace, the first
   night: exit 0 (README's DDP example is skipped under ``--with-compiled-ddp``, not
   failed), no reproducer, a baseline to save. The cases are narrowed to the averaging
   and compiled ones through ``PYTEST_ADDOPTS``, which the recipe does not set. README
   says what ``make conform``'s status means, and the recipe does not use it.

Runs 1 and 2 see no venv on ``PATH`` either, so the command they print is the
interpreter's own (``/path/to/python -m conformance``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.apis.ddp.plan import COMPILED_NOT_DECLARED
from conformance.reproducers import writer
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
    "mytrain/hooks.py": '''
        import torch.distributed as dist

        from models.comm_utils import mean_factor


        def mean(process_group, bucket):
            tensor = bucket.buffer().mul_(mean_factor(process_group))
            fut = dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])


        def total(process_group, bucket):
            fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
    ''',
    "mytrain/ci.py": '''
        from conformance import HookSpec
        from fixtures import SUM_NAME
        from mytrain.hooks import mean, total
        from tests.helpers import pg_state

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


def nightly_section() -> str:
    """The manual's nightly job (docs/nightly.md), to the next section."""
    page = Path(REPO, "docs", "nightly.md").read_text()
    return page.split("\n## A complete nightly job (GitHub Actions)\n", 1)[1].split("\n## ", 1)[0]


def nightly_step(step_id: str) -> str:
    """The YAML of the step ``id: step_id`` in README's nightly workflow, as written."""
    workflow = re.search(r"```yaml\n(.*?)```", nightly_section(), re.S).group(1)
    steps = re.split(r"\n(?=      - )", workflow)
    return next(step for step in steps if re.search(rf"^\s+id: {step_id}$", step, re.M))


def recipe_script() -> str:
    """The ``run: |`` of README's conformance step, as written, with README's example specs for the user's."""
    step = nightly_step("conform")
    body = step.split("run: |\n", 1)[1]
    script = textwrap.dedent(body)
    assert script.count(RECIPE_HOOKS) == 1, script
    return script.replace(RECIPE_HOOKS, "conformance.examples.my_specs:SPECS")


#: The user's specs in README's recipe, and the cases the scripted night selects (through PYTEST_ADDOPTS).
RECIPE_HOOKS = "my_pkg.specs:SPECS"
RECIPE_CASES = "-p no:randomly -k 'ws2 and (averaging or compiled_autograd)'"


def python_on_path(bindir: Path) -> Path:
    """A directory whose ``python`` is this interpreter (a wrapper: a symlink to a venv's python loses the venv)."""
    bindir.mkdir()
    wrapper = bindir / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    return bindir


@pytest.fixture(scope="module")
def runs(myrepo, tmp_path_factory):
    """Runs 1 and 2, and README's nightly recipe (5), side by side: (exit code, output, cases) of each, run 2's
    JSON results, run 1's reproducers' directory, and the recipe's workspace."""
    out = tmp_path_factory.mktemp("runs")
    workspace = tmp_path_factory.mktemp("workspace")
    bindir = python_on_path(out / "bin")
    recipe_env = clean_env(PATH=f"{bindir}:{CLEAN_PATH}", GITHUB_OUTPUT=str(out / "github_output"),
                           PYTEST_ADDOPTS=RECIPE_CASES)
    procs = {
        "from_repo": suite([*SELECT, "--write-reproducers", str(out / "repro")], myrepo, out / "repo.xml",
                           clean_env()),
        "from_checkout": suite([*SELECT, "--json", str(out / "checkout.json")], Path(REPO), out / "checkout.xml",
                               clean_env(PYTHONPATH=str(myrepo))),
        "recipe": subprocess.Popen(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", recipe_script()],
                                   cwd=str(workspace), env=recipe_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True),
    }
    results = {}
    for key, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        junit = {"from_repo": out / "repo.xml", "from_checkout": out / "checkout.xml",
                 "recipe": workspace / "reports" / "conformance.xml"}[key]
        results[key] = (proc.returncode, text, read_junit(str(junit)) if junit.exists() else [])
    results["json"] = json.loads((out / "checkout.json").read_text()) if (out / "checkout.json").exists() else {}
    results["repro"] = out / "repro"
    results["workspace"] = workspace
    results["github_output"] = (out / "github_output").read_text() if (out / "github_output").exists() else ""
    return results


@pytest.mark.parametrize("where", ["from_repo", "from_checkout"])
def test_the_user_s_packages_load_on_every_rank_and_the_verdicts_are_right(runs, where):
    rc, output, cases = runs[where]
    assert rc == 1, output[-4000:]
    assert sorted((c.hook, c.outcome) for c in cases) == [("newcomer_mean", "passed"), ("newcomer_sum", "failed")]
    assert "newcomer_mean                CONFORMS" in output
    # Two of each hook's cases ran: the verdict says it covers only those (issue 31).
    assert "a verdict on the 1 case(s) -k 'test_ddp_averaging' selected, not on all " in output
    assert "DOES NOT CONFORM (averaging)" in output


def test_the_run_from_the_checkout_names_its_world_sizes_and_says_what_its_counts_mean(runs):
    rc, output, _ = runs["from_checkout"]
    header = next(line for line in output.splitlines() if line.startswith("conformance: torch"))
    assert "  hook newcomer_mean [ddp; full-precision averaging] from mytrain.ci:SPECS" in output  # no empty field
    assert "world sizes 2 and 4 (4 for test_ddp_parity)" in header, header  # the subgroup config needs 4 ranks
    assert runs["json"]["environment"]["world_sizes"] == [2, 4]
    counts = output.split("what the counts mean", 1)[1]
    assert "1 passed: " in counts and "1 failed: " in counts and "xfailed" not in counts
    assert ("every test of api fsdp, fsdp2, fsdp2_all_gather, fsdp2_all_reduce and fsdp2_replica (no hook under test has that api)"
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


# -- 1 and 4: the reproducers ---------------------------------------------------------------------------------

def test_only_the_failed_case_got_a_reproducer(runs):
    _, _, cases = runs["from_repo"]
    written = sorted(os.listdir(runs["repro"]))
    failed = [c for c in cases if c.outcome == "failed"]
    assert written == [os.path.basename(writer.reproducer_path(str(runs["repro"]), c.name)) for c in failed]
    assert any(c.outcome == "passed" for c in cases)


def _printed_reproducer_command(message: str) -> str:
    match = re.search(r"^(?:E +)?Standalone reproducer: .*\n(?:E +)?  (.*?)   \(from this directory", message, re.M)
    assert match, message[-3000:]
    return match.group(1)


def test_the_printed_reproducer_reproduces_from_the_repository_without_the_suite(runs, myrepo, tmp_path):
    """Pasted at the repository's root (where the run started), with a ``conformance`` that raises on import first
    on the path: the hook imports from the working directory, nothing of the suite is needed, exit 1."""
    _, _, cases = runs["from_repo"]
    failed = next(c for c in cases if c.outcome == "failed")
    command = _printed_reproducer_command(failed.message)
    blocker = tmp_path / "blocker" / "conformance"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the reproducer imported conformance')\n")
    proc = subprocess.run(["/bin/sh", "-c", command], cwd=str(myrepo), env=clean_env(PYTHONPATH=str(blocker.parent)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "the difference reproduces: hook newcomer_sum differs from DDP with no hook at step 0" in proc.stdout


def test_a_reproducer_whose_hook_module_is_missing_exits_2_naming_it(runs, tmp_path):
    _, _, cases = runs["from_repo"]
    command = _printed_reproducer_command(next(c for c in cases if c.outcome == "failed").message)
    proc = subprocess.run(["/bin/sh", "-c", command], cwd=str(tmp_path), env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "could not run: ModuleNotFoundError: No module named 'mytrain' (run this file from the directory"), proc.stdout


# -- 5: README's nightly recipe -------------------------------------------------------------------------------

def test_readme_s_nightly_recipe_runs_as_written_and_passes_on_readme_s_example_hooks(runs):
    rc, output, cases = runs["recipe"]
    assert rc == 0, output[-4000:]
    assert {"first=true", "status=0"} <= set(runs["github_output"].split()), runs["github_output"]
    ran = {(c.hook, c.outcome) for c in cases}
    assert {("my_fp16", "passed"), ("my_ddp_mean", "passed")} <= ran, ran
    compiled = [c for c in cases if "compiled_autograd" in c.name]
    assert compiled and all(c.outcome == "skipped" and COMPILED_NOT_DECLARED in c.message for c in compiled)
    reports = runs["workspace"] / "reports"
    assert json.loads((reports / "conformance.json").read_text())["run"]["complete"] is True
    assert not (reports / "reproducers").exists() or not os.listdir(reports / "reproducers")


def test_the_first_night_saves_its_baseline_red_or_green_from_both_checkouts():
    """The workflow checks out the user's repository at the root and the suite beside it, sets the suite up from
    there, runs the suite from the root; the baseline step takes the first night's results even when red."""
    section = nightly_section()
    checkouts = re.findall(r"^      - uses: actions/checkout@v4.*(?:\n        with: .*)?$", section, re.M)
    assert len(checkouts) == 2, checkouts
    suite_path = re.search(r"repository: [\w.-]+/commhook-conformance, path: ([\w.-]+)\}", checkouts[1]).group(1)
    assert f"make -C {suite_path} setup PYTHON=python" in section
    assert "working-directory" not in nightly_step("conform")  # from the workspace root: the user's checkout
    condition = re.search(r"^        if: (.*)$", nightly_step("baseline"), re.M).group(1)
    assert "steps.conform.outputs.first == 'true' && steps.conform.outputs.status == '1'" in condition
    assert condition.startswith("always() && ")  # a failed step before it would skip it otherwise


def test_make_conform_s_status_is_documented_and_the_recipe_runs_the_suite_itself():
    readme = Path(REPO, "README.md").read_text()
    commands = readme.split("\n## The two commands\n", 1)[1].split("\n## ", 1)[0]
    assert "GNU make turns any failed recipe into 2" in commands and "python -m conformance" in commands
    assert "`make conform` (whose status is 2 for any failure)" in nightly_section()
    script = nightly_step("conform")
    assert "python -m conformance " in script and "make conform" not in script
