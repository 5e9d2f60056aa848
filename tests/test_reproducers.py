"""Standalone reproducers: each failed case's file runs where the suite cannot be imported, and only failed cases
get one.

The zoo runs (``tests/meta_zoos/``) write a reproducer per failed case
(``--write-reproducers``); a case that passed gets none. For one zoo hook of every
API (an averaging case, a parity case, a hard-input case with its shrunk input),
this test runs the file as its author would, ``python file.py`` (it starts its
own ranks), in a clean directory: the hook's module (``tests/zoo/plain_hooks.py``,
torch only) beside a ``conformance`` package that raises on import, so anything
of the suite the file used would fail it. Each must exit 1 and print the
parameter the suite named; with ``--without-hook`` (both copies native) it
must exit 0 (two of them, each launch costing seconds). One also runs as
torchrun's workers (``torchrun --standalone --nproc-per-node N file.py``), which must
print the same verdict line.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from conformance.controller.options import SettingsError
from conformance.reproducers import writer
from conformance.shared import standalone_launch, standalone_main
from tests.meta_helpers import BackgroundJob, ZooRuns
from tests.meta_zoos import DDP, FSDP, FSDP2, ZOOS
from tests.test_reproducer_content import PARITY_LINES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``(zoo, case name)``: one failed case of a zoo hook of each API, whose hook lives in ``tests/zoo/plain_hooks.py``.
CASES = [
    (DDP, "test_ddp_hard_inputs[bad_saturates_inf_off_rank0-default-gradient_probe-ws2]"),  # shrunk input
    (FSDP, "test_averaging[bad_sum_no_average-FULL_SHARD-ws2]"),
    (FSDP, "test_clip_grad_norm[bad_sum_no_average-FULL_SHARD-nested_wrapped-ws2]"),  # issue 48: clip too
    (FSDP2, "test_fsdp2_parity[bad_always_sum-default-nested_wrapped-ws2]"),
    (FSDP2, "test_fsdp2_all_reduce_hook[bad_replica_divide_hook-replicate-nested_wrapped-ws2]"),
    (FSDP2, "test_fsdp2_replica_parity[bad_replica_sum-replica-nested_wrapped-2nodes-ws4]"),
]
IDS = [name.split("[", 1)[0][5:] for _, name in CASES]


def _clean_dir(root: str) -> str:
    """The hook's module with its packages, and a ``conformance`` that raises on import, under ``root``."""
    os.makedirs(root, exist_ok=True)
    os.makedirs(os.path.join(root, "tests", "zoo"))
    os.makedirs(os.path.join(root, "conformance"))
    with open(os.path.join(root, "conformance", "__init__.py"), "w") as out:
        out.write("raise ImportError('a standalone reproducer imported conformance')\n")
    for name in ("tests/__init__.py", "tests/zoo/__init__.py", "tests/zoo/plain_hooks.py"):
        shutil.copy(os.path.join(REPO, name), os.path.join(root, name))
    return root


def _clean_env(base_env: Dict[str, str], cwd: str) -> Dict[str, str]:
    env = {k: v for k, v in base_env.items() if not k.startswith(("CONFORM_", "PYTHON", "MASTER_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = cwd
    return env


def _launch(path: str, world_size: int, cwd: str, base_env: Dict[str, str], how: str, *extra: str
            ) -> Tuple[int, str]:
    """Run the file ``how``: ``python`` (it starts its own ranks) or ``torchrun`` (as its workers)."""
    launcher = ([] if how == "python" else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"])
    proc = subprocess.run([sys.executable, *launcher, path, *extra], cwd=cwd, env=_clean_env(base_env, cwd),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return proc.returncode, proc.stdout


#: The cases whose reproducer also runs under torchrun, and with ``--without-hook``: each launch costs seconds of
#: a 2-core machine, so every case runs once as its author would, and these once more.
UNDER_TORCHRUN = (CASES[0][1],)
WITHOUT_HOOK = (CASES[1][1], CASES[2][1], CASES[3][1])


#: The parity reproducers measured and run beside :data:`CASES` (issue 29: short, and still reproducing): of each
#: zoo, the first written file of a parity case on ``nested_wrapped`` that imports only torch and the hook's module.
PARITY_ZOOS = {"ddp": (DDP, "test_ddp_parity_"), "fsdp": (FSDP, "test_parity_"), "fsdp2": (FSDP2, "test_fsdp2_parity_")}


def _parity_file(runs: ZooRuns, api: str) -> Optional[str]:
    zoo, prefix = PARITY_ZOOS[api]
    directory = runs.reproducers(zoo)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if name.startswith(prefix) and "-nested_wrapped-" in name and \
                "It needs commhook-conformance installed" not in open(path).read():  # torch and the hook's alone
            return path
    return None


def _launch_all(runs: ZooRuns, directory: str, env: Dict[str, str]) -> Dict[str, Dict[str, object]]:
    """Per case: the suite's failure, the reproducer's path, and its runs (two at a time): ``hooked`` with
    ``python file.py``; ``native`` (``--without-hook``) for :data:`WITHOUT_HOOK`; ``torchrun`` for
    :data:`UNDER_TORCHRUN`."""
    clean = _clean_dir(os.path.join(directory, "clean"))
    out: Dict[str, Dict[str, object]] = {}
    jobs: List[Tuple[str, str, str, int, str, Tuple[str, ...]]] = []
    for zoo, name in CASES:
        run = runs(zoo)
        failed = [c for c in run.cases if c.name == name]
        path = writer.reproducer_path(runs.reproducers(zoo), name)
        world_size = int(re.search(r"-ws(\d+)\]$", name).group(1))
        out[name] = {"case": failed[0] if failed else None, "path": path}
        if os.path.exists(path):
            jobs.append((name, "hooked", path, world_size, "python", ()))
            if name in WITHOUT_HOOK:
                jobs.append((name, "native", path, world_size, "python", ("--without-hook",)))
            if name in UNDER_TORCHRUN:
                jobs.append((name, "torchrun", path, world_size, "torchrun", ()))
    for api in PARITY_ZOOS:
        path = _parity_file(runs, api)
        out[f"parity:{api}"] = {"path": path}
        if path is not None:
            world_size = int(re.search(r"-ws(\d+)\.py$", path).group(1))
            jobs.append((f"parity:{api}", "hooked", path, world_size, "python", ()))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {pool.submit(_launch, path, ws, clean, env, how, *extra): (name, which)
                   for name, which, path, ws, how, extra in jobs}
        for future, (name, which) in futures.items():
            out[name][which] = future.result()
    return out


#: The launches, in the zoo runs' background threads once the zoo runs are done (``tests/conftest.py``).
LAUNCHES = BackgroundJob("reproducer_launches", _launch_all)


@pytest.fixture(scope="module")
def launched(zoo_runs) -> Dict[str, Dict[str, object]]:
    return zoo_runs(LAUNCHES)


@pytest.mark.parametrize("name", [name for _, name in CASES], ids=IDS)
def test_the_reproducer_reproduces_the_failure_without_the_suite(launched, name):
    got = launched[name]
    case = got["case"]
    assert case is not None and case.outcome == "failed", f"{name} did not fail in its zoo run"
    assert f"Standalone reproducer: {got['path']}" in case.message, case.message[-2000:]
    assert os.path.exists(got["path"]), got["path"]
    code, output = got["hooked"]
    assert code == 1, output[-4000:]
    lines = re.findall(r"^\[rank \d+, step (\d+), parameter '([^']+)'\] .* differs from .*: first difference at "
                       r"index .*: got .* \((0x[0-9a-f]+)\), but expected .* \((0x[0-9a-f]+)\)", output, re.M)
    assert lines, output[-4000:]
    step, fqn, got_bits, want_bits = lines[0]
    assert got_bits != want_bits
    if fqn == "total norm":  # the clip check: the total norm of clip_grad_norm_, which the suite compares first too
        assert "the total norm of clip_grad_norm_(norm_type=" in output and "total norm (norm_type=" in case.message
    else:
        assert f"parameter '{fqn}'" in case.message or f"{fqn}[" in case.message, (fqn, case.message[:3000])
    verdicts = [line for line in output.splitlines() if line.startswith("the difference reproduces: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith(f"the difference reproduces: hook {case.hook} differs"), \
        output[-2000:]


@pytest.mark.parametrize("api", sorted(PARITY_ZOOS))
def test_a_parity_reproducer_of_each_api_is_short_and_still_reproduces(launched, api):
    """A zoo's parity reproducer holds only what its case runs (tests/test_reproducer_content.py's budget, plus the
    failure's lines its docstring quotes) and, run as its author would, still reproduces the difference."""
    got = launched[f"parity:{api}"]
    assert got["path"] is not None, f"the {api} zoo wrote no parity reproducer of a plain_hooks hook"
    text = open(got["path"]).read()
    assert text.count("\n") <= PARITY_LINES[api] + 5, (text.count("\n"), got["path"])
    code, output = got["hooked"]
    verdicts = [line for line in output.splitlines() if line.startswith("the difference reproduces: hook ")]
    assert code == 1 and len(verdicts) == 1, output[-4000:]


@pytest.mark.parametrize("name", UNDER_TORCHRUN, ids=[n.split("[", 1)[0][5:] for n in UNDER_TORCHRUN])
def test_under_torchrun_the_reproducer_prints_the_same_verdict_line(launched, name):
    """As torchrun's workers the file gives the verdict line of ``python file.py`` (torchrun's own status is 1 for
    any failed worker, whatever the reason, so the line is what to read there)."""
    code, output = launched[name]["torchrun"]
    verdict = next(line for line in launched[name]["hooked"][1].splitlines()
                   if line.startswith("the difference reproduces: "))
    assert code == 1 and verdict in output.splitlines(), (verdict, output[-4000:])


@pytest.mark.parametrize("name", WITHOUT_HOOK, ids=[n.split("[", 1)[0][5:] for n in WITHOUT_HOOK])
def test_the_reproducer_without_the_hook_finds_no_difference(launched, name):
    code, output = launched[name]["native"]
    assert code == 0, output[-4000:]
    assert "no difference in" in output and "differs from" not in output, output[-3000:]


def test_a_shrunk_hard_input_is_the_one_the_reproducer_feeds(launched):
    """The hard-input reproducer holds the shrunk example (one +Inf off rank 0), not the batch it was found in."""
    name = CASES[0][1]
    text = open(launched[name]["path"]).read()
    inputs = re.search(r"'inputs': (\[.*\]),\n", text).group(1)
    assert inputs.count("'inf'") == 1 and inputs.count("[[[") == 1, inputs[:500]


def test_a_clip_case_replays_the_norm_type_that_failed_and_not_the_step_without_backward():
    """Issue 48, item 7: a clip_grad_norm failure's file runs clip_grad_norm_ after every backward with the suite's
    bound and the norm type its findings name; its last step (a forward with no backward) no file replays."""
    from conformance.protocol import Finding
    from conformance.catalogue import CLIP_MAX_NORM

    found = [Finding(0, "total gradient norm differs", step=1, fqn="total norm (norm_type=inf)")]
    case = writer.case_literal(type("S", (), {"name": "h", "reduce_dtype": None})(),
                               "ddp.clip_grad_norm", {"config": "default", "model": "nested_wrapped"}, 2, "x", found)
    assert case["clip"] == {"max_norm": CLIP_MAX_NORM, "norm_type": "inf"} and case["steps"] == 2
    assert writer.case_literal(type("S", (), {"name": "h", "reduce_dtype": None})(), "fsdp.clip_grad_norm",
                               {"strategy": "FULL_SHARD", "model": "nested_wrapped"}, 2, "x",
                               [Finding(0, "differs", step=0)])["clip"]["norm_type"] == "2.0"
    without = [Finding(0, "clip_grad_norm_ warned nothing with the hook, but X on native (a forward with no backward, "
                          "then clip_grad_norm_ norm_type=2.0)")]
    with pytest.raises(writer.NoReproducer, match="a forward with no backward"):
        writer.case_literal(type("S", (), {"name": "h", "reduce_dtype": None})(), "ddp.clip_grad_norm",
                            {"config": "default", "model": "nested_wrapped"}, 2, "x", without)


def test_a_check_without_a_lock_step_has_no_reproducer_and_says_why():
    with pytest.raises(writer.NoReproducer, match="future_contract check is not replayed"):
        writer.case_literal(None, "ddp.future_contract", {"config": "default"}, 2, "x", [])


def test_ddp_cpp_hooks_say_why_they_have_no_reproducer():
    from conformance.apis.ddp.builtin_hooks import DDP_HOOKS

    cpp = [s for s in DDP_HOOKS if s.name.startswith("ddp_cpp_")]
    assert cpp
    with pytest.raises(writer.NoReproducer, match="C\\+\\+ built-in hooks"):
        writer.reproducer_source(cpp[0], "x:Y", "ddp.parity", {"config": "default", "model": "net_flat"}, 2,
                                 "case", [], "header", "rerun", "/tmp/x.py")


def test_a_reproducers_directory_that_cannot_be_written_is_a_usage_error(tmp_path):
    from conformance.controller.option_values import results_paths

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SettingsError, match="reproducers' directory"):
        results_paths(lambda dest: (str(blocker / "sub") if dest == "conform_write_reproducers" else None, "--x"))


def test_case_ids_become_file_names_a_shell_takes_unquoted(tmp_path):
    path = writer.reproducer_path(str(tmp_path), "test_ddp_parity[a b-default-net_flat-ws3]")
    assert os.path.basename(path) == "test_ddp_parity_a_b-default-net_flat-ws3.py"


def test_readme_shows_the_head_of_a_reproducer_as_generated():
    """The manual's reproducer page (docs/reproducers.md) shows the hook imports and the case of a generated file,
    and the DDP build that follows, verbatim."""
    from conformance.protocol import Finding
    from tests.zoo import ddp_hooks

    page = open(os.path.join(REPO, "docs", "reproducers.md")).read()
    shown = page.split("# A standalone reproducer", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    shown = shown[shown.index("# -- the hook under test"):]
    spec = next(s for s in ddp_hooks.ALL if s.name == "bad_sum_then_divide")
    name = "test_ddp_parity[bad_sum_then_divide-default-nested_wrapped-ws3]"
    source = writer.reproducer_source(spec, "tests.zoo.ddp_hooks:ALL", "ddp.parity",
                                      {"config": "default", "model": "nested_wrapped"}, 3, name,
                                      [Finding(0, "differs", step=0)], "header", "rerun", "/home/me/repro/x.py")
    assert shown in source
    build = page.split("The case's DDP build follows its model", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    assert build.startswith("# -- how the suite builds ddp's models") and build in source


# -- only failed cases get a reproducer ---------------------------------------------------------------------

#: The checks whose failures get a reproducer: a passing case of one of them would have got one before issue 31.
REPLAYED = {"averaging", "parity", "accumulation", "subgroup_parity", "hard_inputs"}


@pytest.mark.parametrize("zoo", ZOOS, ids=[z.name for z in ZOOS])
def test_a_case_that_passed_gets_no_reproducer(zoo_runs, zoo):
    """Issue 31: every file in a zoo run's reproducers' directory is a failed case's; the run's passing cases of
    the replayed checks (hard inputs among them, one dispatch per example) wrote none."""
    run = zoo_runs(zoo)
    directory = zoo_runs.reproducers(zoo)
    written = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    by_file = {os.path.basename(writer.reproducer_path(directory, c.name)): c for c in run.cases}
    assert all(by_file[name].outcome == "failed" for name in written), \
        sorted((name, by_file[name].outcome) for name in written if by_file[name].outcome != "failed")
    passed = [c for c in run.cases if c.outcome == "passed" and any(c.check == r or c.check.endswith(f"_{r}")
                                                                     for r in REPLAYED)]
    assert passed, "no passing case of a replayed check in this run: the test would prove nothing"
    assert not [c.name for c in passed if os.path.basename(writer.reproducer_path(directory, c.name)) in written]


# -- how the file starts its ranks, and what it needs ----------------------------------------------------------

@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_reproducer_runs_on_the_backend_the_suite_placed_the_case_on(backend):
    """A case the suite ran on CPU ranks (gloo) is written for CPU ranks alone, its launcher hiding the GPUs; one it
    ran with a GPU a rank (NCCL) takes the GPU of its ``LOCAL_RANK``."""
    from tests.zoo import ddp_hooks

    spec = next(s for s in ddp_hooks.ALL if s.name == "bad_saturates_inf_off_rank0")
    source = writer.reproducer_source(spec, "tests.zoo.ddp_hooks:ALL", "ddp.parity",
                                      {"config": "default", "model": "net_flat"}, 2, "case", [], "header", "rerun",
                                      "/tmp/x.py", backend=backend)
    assert f"'backend': {backend!r}" in source and 'dist.init_process_group(CASE["backend"])' in source
    on_gpu = 'torch.device("cuda", int(os.environ["LOCAL_RANK"]))' in source
    hides_gpus = 'os.environ["CUDA_VISIBLE_DEVICES"] = ""' in source
    assert (on_gpu, hides_gpus) == ((True, False) if backend == "nccl" else (False, True))
    # NCCL's choices pinned as the suite pins them in its ranks, so the file reproduces the suite's bits
    assert ("pin_nccl(os.environ)" in source and '"NCCL_PROTO": "Simple"' in source) == (backend == "nccl")


@pytest.mark.parametrize("backend, threads, method", [("gloo", 1, "fork"), ("gloo", 2, "spawn"), ("nccl", 1, "spawn")])
def test_cpu_ranks_are_forked_from_a_launcher_of_one_thread_and_gpu_ranks_spawned(monkeypatch, backend, threads,
                                                                                   method):
    """Forked CPU ranks inherit the file's ``import torch`` (seconds of CPU a rank); a second thread in the launcher
    (a hook module's) would leave a forked rank its locks held, and NCCL ranks get a fresh CUDA context each."""
    listdir, methods = os.listdir, []
    monkeypatch.setattr(os, "listdir", lambda path: [str(i) for i in range(threads)] if path == "/proc/self/task"
                        else listdir(path))
    monkeypatch.setattr(os.path, "isdir", lambda path: True)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", lambda fn, nprocs, start_method: methods.append(
        start_method))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")  # what launch sets goes back after the test
    monkeypatch.setattr(standalone_launch, "CASE", {"world_size": 2, "backend": backend}, raising=False)
    monkeypatch.setattr(standalone_launch, "run", standalone_main.run, raising=False)  # the file's, in one module
    assert standalone_launch.launch() == standalone_launch.NOT_REPRODUCED and methods == [method]


@pytest.mark.parametrize("code, expected, line", [
    (1, 1, None), (2, 2, None),  # a verdict: a rank saw the difference (or its hook raised), or could not run
    (-9, 2, "could not run: rank 1 was killed by signal SIGKILL"), (3, 2, "could not run: rank 1 exited with status 3"),
])
def test_the_launcher_s_status_is_reproduced_or_could_not_run_where_a_rank_exits_other_than_0(monkeypatch, capsys, code,
                                                                                               expected, line):
    """``torch.multiprocessing.start_processes`` raises for the first rank that exited other than 0 (it stops the
    others): its verdict where it has one, else "could not run", naming the signal or the status."""
    def start_processes(fn, nprocs, start_method):
        assert fn is standalone_main.run and nprocs == 2
        raise torch.multiprocessing.ProcessExitedException("exited", error_index=1, error_pid=0, exit_code=code)

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")  # what launch sets goes back after the test
    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes)
    monkeypatch.setattr(standalone_launch, "CASE", {"world_size": 2, "backend": "gloo"}, raising=False)
    monkeypatch.setattr(standalone_launch, "run", standalone_main.run, raising=False)  # the file's, in one module
    assert standalone_launch.launch() == expected
    printed = capsys.readouterr().out.strip()
    assert printed == (line or "")


def test_the_printed_command_runs_the_file_with_this_interpreter(tmp_path):
    from conformance.controller.cli import python_words

    here = os.path.dirname(os.path.abspath(sys.executable))
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    (elsewhere / "python").write_text("#!/bin/sh\n")
    (elsewhere / "python").chmod(0o755)
    assert python_words(str(elsewhere)) == [sys.executable]  # another python first on PATH
    if os.path.exists(os.path.join(here, "python")):
        assert python_words(here) == ["python"]


def test_a_hook_whose_module_imports_the_suite_is_said_to_need_it():
    """README's layout keeps hooks (torch only) and their specs apart; a file whose hook module imports the suite
    says it needs it, in the file and in the failure."""
    from tests.zoo import ddp_hooks

    mixed = next(s for s in ddp_hooks.ALL if s.name == "bad_divides_by_world_size")  # defined beside its HookSpec
    apart = next(s for s in ddp_hooks.ALL if s.name == "bad_saturates_inf_off_rank0")  # from plain_hooks
    why = writer.needs_the_suite(mixed, "tests.zoo.ddp_hooks:ALL")
    assert why and "tests.zoo.ddp_hooks.arithmetic imports conformance" in why and "HookSpecs in another" in why
    assert writer.needs_the_suite(apart, "tests.zoo.ddp_hooks:ALL") is None
    source = writer.reproducer_source(mixed, "tests.zoo.ddp_hooks:ALL", "ddp.parity",
                                      {"config": "default", "model": "net_flat"}, 2, "case", [], "header", "rerun",
                                      "/tmp/x.py")
    assert f"It needs commhook-conformance installed: {why}" in source
    hint = ast.literal_eval(re.search(r"^IMPORT_HINT = (\(.*?\))$", source, re.M | re.S).group(1))
    assert hint == f"this file needs commhook-conformance installed: {why}"  # said where the import fails
