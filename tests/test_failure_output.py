"""What a failed case prints, as a hook author outside this repository sees it.

The hooks live in a package of a temporary directory that only ``PYTHONPATH``
makes importable (as a user's hooks usually are), and the suite runs from
another directory. One hook sums without averaging (its findings are the
report), one raises inside its own code on every rank (its traceback is the
report).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.controller.cli import command_words
from tests.meta_helpers import BackgroundJob, failures_section, read_junit, rerun_command, run_suite

HOOKS = '''
    import torch.distributed as dist

    from conformance import HookSpec


    def sum_without_average(process_group, bucket):
        fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


    def compress_or_raise(process_group, bucket):
        raise ValueError(f"my_comm_hooks: a bucket of {bucket.buffer().numel()} elements is too large to compress")


    def pg_state(process_group):
        return process_group


    SPECS = [
        HookSpec(name="mine_sum_without_average", api="ddp", hook=sum_without_average, state=pg_state),
        HookSpec(name="mine_raises", api="ddp", hook=compress_or_raise, state=pg_state),
    ]
'''
TARGET = "my_comm_hooks.ddp:SPECS"
#: One averaging case per hook, at world size 2.
SELECT = ["--extra-world-size", "0", "-k", "test_ddp_averaging"]


#: The traceback styles a failure must read the same under.
STYLES = ("long", "short", "auto")


def _runs_with_tb(runs, directory, env):
    """The hooks' package under ``directory``, and the suite over them once per traceback style, each from a
    directory of its own with the hooks' directory on ``PYTHONPATH``: ``(hooks_dir, {style: run})``."""
    root = Path(directory) / "hooks_on_pythonpath"
    (root / "my_comm_hooks").mkdir(parents=True)
    (root / "my_comm_hooks" / "__init__.py").write_text("")
    (root / "my_comm_hooks" / "ddp.py").write_text(textwrap.dedent(HOOKS))
    out = {}
    for tb in STYLES:
        work = Path(directory) / f"work_tb_{tb}"
        work.mkdir()
        out[tb] = run_suite([f"--tb={tb}", "--hook", TARGET, *SELECT], str(work / "report.xml"), cwd=str(work),
                            pythonpath=[str(root)], timeout=300, env=env)
    return root, out


#: The runs, in the zoo runs' background threads (``tests/conftest.py``).
TB_RUNS = BackgroundJob("failure_output_tb", _runs_with_tb)


@pytest.fixture(scope="module")
def hooks_dir(zoo_runs) -> Path:
    return zoo_runs(TB_RUNS)[0]


@pytest.fixture(scope="module")
def run_with_tb(zoo_runs):
    """``run_with_tb(style)``: the suite over the hooks with ``--tb=style`` (:data:`TB_RUNS`)."""
    return zoo_runs(TB_RUNS)[1].__getitem__


@pytest.mark.parametrize("tb", STYLES)
def test_a_failure_shows_the_suite_message_alone_whatever_the_traceback_style(run_with_tb, tb):
    run = run_with_tb(tb)
    assert run.returncode == 1, run.output[-4000:]
    shown = failures_section(run.output)
    # Nothing of pytest's own traceback through the suite's test function and the runner.
    for noise in ("conformance/suite/", "conform = <", "request = <", "ConformanceFailure", "runner.py"):
        assert noise not in shown, f"{noise!r} in the failures printed with --tb={tb}:\n{shown}"
    # The suite's message: header, findings, the re-run command, for each hook.
    assert "hook mine_sum_without_average does not conform: check=averaging" in shown
    assert "gradient is not the average over ranks" in shown
    assert "hook mine_raises does not conform: check=averaging" in shown
    assert shown.count("Re-run just this case:") == 2
    # The hook's own traceback, raised on each rank, stays in full: its frame, its source line, its error.
    raise_line = next(i for i, ln in enumerate(textwrap.dedent(HOOKS).splitlines(), 1) if "raise ValueError" in ln)
    assert shown.count(f'my_comm_hooks/ddp.py", line {raise_line}, in compress_or_raise') == 2
    assert shown.count("ValueError: my_comm_hooks: a bucket of") == 2

    # JUnit XML carries the whole message too.
    failed = {c.hook: c.message for c in run.cases if c.outcome == "failed"}
    assert set(failed) == {"mine_sum_without_average", "mine_raises"}
    for hook, message in failed.items():
        assert f"hook {hook} does not conform" in message and "Re-run just this case:" in message
        assert "conformance/suite/" not in message
    assert "in compress_or_raise" in failed["mine_raises"]


def test_the_rerun_command_reproduces_the_case_from_a_fresh_shell(run_with_tb, hooks_dir, tmp_path):
    case = next(c for c in run_with_tb("short").cases if c.hook == "mine_sum_without_average")
    command = rerun_command(case.message)
    conform = " ".join(shlex.quote(w) for w in command_words())  # `conform`, or this python -m conformance
    assert command.startswith(f"PYTHONPATH={hooks_dir} {conform} --hook {TARGET} "), command
    # A fresh shell: the venv's scripts on PATH, no PYTHONPATH, another working directory.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")

    def shell(line: str, junit: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"{line} --junitxml={junit} -p no:randomly"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)

    proc = shell(command, tmp_path / "rerun.xml")
    assert proc.returncode == 1, proc.stdout[-4000:]
    again = read_junit(str(tmp_path / "rerun.xml"))
    assert [(c.name, c.outcome) for c in again] == [(case.name, "failed")], proc.stdout[-4000:]
    assert again[0].message.splitlines()[:2] == case.message.splitlines()[:2]  # the header and first finding
    # Without the PYTHONPATH it carries, the same command cannot import the hook (usage error, exit 4).
    bare = shell(command[len(f"PYTHONPATH={hooks_dir} "):], tmp_path / "bare.xml")
    assert bare.returncode == 4 and "cannot import module 'my_comm_hooks.ddp'" in bare.stdout, bare.stdout[-3000:]
