"""Tests for conformance.controller.settings: command line > environment > machine default, and the errors.

``resolve`` is fed a fake ``getoption`` that answers like pytest does for options
nobody gave (``[]`` for repeatable options, ``False`` for flags, ``None`` otherwise),
an explicit environment and an explicit GPU count, so no test depends on this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.controller.settings import (CPU_RANK_MEMORY_BYTES, DEFAULT_HYPOTHESIS_EXAMPLES, DEFAULT_RANK_LOG_LIMIT_MIB,
                                  DEFAULT_RANK_MEMORY_GROWTH_MIB, HYPOTHESIS_SEED_DEST, OPTIONS, Settings,
                                  SettingsError, resolve)

REPO = Path(__file__).resolve().parents[1]
DESTS = {o.dest for o in OPTIONS} | {HYPOTHESIS_SEED_DEST}
UNSET = {"conform_hooks": [], "conform_known_failures": [], "conform_with_builtins": False,
         "conform_no_entry_points": False, "conform_strict_known_failures": False, "conform_with_compiled_ddp": False}


def getoption(**given):
    unknown = set(given) - DESTS
    assert not unknown, f"test bug: no such option dest {unknown}"

    def get(dest):
        assert dest in DESTS, f"resolve asked for undeclared option {dest!r}"
        return given.get(dest, UNSET.get(dest))

    return get


def settings(cli=None, env=None, gpus=0) -> Settings:
    return resolve(getoption(**(cli or {})), dict(env or {}), gpus)


def settings_error(cli=None, env=None, gpus=0) -> str:
    with pytest.raises(SettingsError) as info:
        settings(cli, env, gpus)
    return str(info.value)


def test_every_option_has_a_flag_and_a_distinct_destination():
    assert all(o.flag.startswith("--") for o in OPTIONS)
    assert len(DESTS - {HYPOTHESIS_SEED_DEST}) == len(OPTIONS)
    envs = [o.env for o in OPTIONS if o.env]
    assert all(e.startswith("CONFORM_") for e in envs) and len(set(envs)) == len(envs)


# -- defaults from the machine -----------------------------------------------------------


def test_cpu_machine_defaults_to_gloo_on_two_ranks_plus_three():
    s = settings(gpus=0)
    assert (s.backend, s.device, s.world_size, s.extra_world_size) == ("gloo", "cpu", 2, 3)
    assert s.world_sizes == (2, 3)
    assert s.gpu_count == 0


def test_four_gpu_machine_defaults_to_nccl_one_rank_per_gpu():
    s = settings(gpus=4)
    assert (s.backend, s.device, s.world_size) == ("nccl", "cuda", 4)
    assert s.world_sizes == (4, 3)
    assert all(s.world_size_unavailable(ws) is None for ws in s.world_sizes)


def test_other_defaults():
    s = settings()
    assert s.case_timeout_s == 60.0
    assert s.hypothesis_examples == DEFAULT_HYPOTHESIS_EXAMPLES
    assert s.hooks == ()
    assert s.builtins and s.entry_points
    (known,) = s.known_failures
    assert Path(known).is_file()
    assert Path(known) == REPO / "fixtures" / "known_failures.toml"


# -- precedence: command line > environment > default -------------------------------------


@pytest.mark.parametrize("dest, env_name, attr, cli_value, env_value, default, parsed", [
    ("conform_world_size", "CONFORM_WORLD_SIZE", "world_size", "5", "4", 2, int),
    ("conform_extra_world_size", "CONFORM_EXTRA_WORLD_SIZE", "extra_world_size", "7", "6", 3, int),
    ("conform_case_timeout", "CONFORM_CASE_TIMEOUT", "case_timeout_s", "12.5", "30", 60.0, float),
    ("conform_hypothesis_examples", "CONFORM_HYPOTHESIS_EXAMPLES", "hypothesis_examples", "9", "1", DEFAULT_HYPOTHESIS_EXAMPLES, int),
])
def test_command_line_beats_environment_beats_default(dest, env_name, attr, cli_value, env_value, default, parsed):
    assert getattr(settings(cli={dest: cli_value}, env={env_name: env_value}), attr) == parsed(cli_value)
    assert getattr(settings(env={env_name: env_value}), attr) == parsed(env_value)
    assert getattr(settings(), attr) == default


def test_backend_and_device_follow_the_same_precedence():
    assert settings(cli={"conform_backend": "gloo"}, env={"CONFORM_BACKEND": "nccl"}, gpus=2).backend == "gloo"
    assert settings(env={"CONFORM_BACKEND": "gloo"}, gpus=2).backend == "gloo"
    assert settings(cli={"conform_device": "cpu"}, env={"CONFORM_DEVICE": "cuda"}, gpus=2).device == "cpu"
    assert settings(env={"CONFORM_DEVICE": "cpu"}, gpus=2).device == "cpu"


def test_cpu_chosen_on_a_gpu_machine_defaults_to_gloo_and_two_ranks():
    s = settings(cli={"conform_device": "cpu"}, gpus=8)
    assert (s.backend, s.world_size) == ("gloo", 2)
    assert s.world_size_unavailable(64) is None


def test_blank_environment_value_counts_as_unset():
    s = settings(env={"CONFORM_WORLD_SIZE": "   ", "CONFORM_BACKEND": ""})
    assert (s.world_size, s.backend) == (2, "gloo")


def test_environment_value_is_stripped():
    assert settings(env={"CONFORM_WORLD_SIZE": " 3\n"}).world_size == 3


def test_hooks_from_environment_are_space_separated():
    s = settings(env={"CONFORM_HOOKS": "  pkg.a:SPEC\tpkg.b:ALL   other:X "})
    assert s.hooks == ("pkg.a:SPEC", "pkg.b:ALL", "other:X")


def test_hooks_on_the_command_line_replace_those_in_the_environment():
    s = settings(cli={"conform_hooks": ["cli.mod:SPEC"]}, env={"CONFORM_HOOKS": "env.a:S env.b:S"})
    assert s.hooks == ("cli.mod:SPEC",)


def test_giving_hooks_turns_builtins_and_entry_points_off_unless_asked():
    s = settings(cli={"conform_hooks": ["m:SPEC"]})
    assert not s.builtins and not s.entry_points
    s = settings(cli={"conform_hooks": ["m:SPEC"], "conform_with_builtins": True})
    assert s.builtins and s.entry_points
    s = settings(cli={"conform_no_entry_points": True})
    assert s.builtins and not s.entry_points


def test_known_failures_from_environment_use_the_path_separator(tmp_path):
    a, b = str(tmp_path / "a.toml"), str(tmp_path / "b.toml")
    packaged = str(REPO / "fixtures" / "known_failures.toml")
    assert settings(env={"CONFORM_KNOWN_FAILURES": os.pathsep.join([a, b])}).known_failures == (packaged, a, b)
    assert settings(cli={"conform_known_failures": [b]}, env={"CONFORM_KNOWN_FAILURES": a}).known_failures == (packaged, b)


def test_extra_world_size_zero_means_none():
    s = settings(cli={"conform_extra_world_size": "0"})
    assert s.extra_world_size is None
    assert s.world_sizes == (2,)


# -- errors name where the bad value came from ---------------------------------------------


@pytest.mark.parametrize("cli, env, source", [
    ({"conform_world_size": "8"}, {}, "--world-size"),
    ({}, {"CONFORM_WORLD_SIZE": "8"}, "CONFORM_WORLD_SIZE"),
])
def test_more_ranks_than_gpus_says_how_many_gpus_and_the_fix(cli, env, source):
    message = settings_error(cli, env, gpus=4)
    assert source in message
    assert "4 GPU" in message
    assert "--world-size 4" in message  # the fix: as many ranks as GPUs
    assert "--device cpu" in message    # or CPU ranks


@pytest.mark.parametrize("cli, env, source", [
    ({"conform_backend": "nccl"}, {}, "--backend"),
    ({}, {"CONFORM_BACKEND": "nccl"}, "CONFORM_BACKEND"),
])
def test_nccl_on_cpu_is_refused(cli, env, source):
    message = settings_error(cli, env, gpus=0)
    assert source in message
    assert "gloo" in message


def test_nccl_with_cpu_chosen_on_a_gpu_machine_is_refused():
    message = settings_error({"conform_backend": "nccl", "conform_device": "cpu"}, gpus=2)
    assert "--backend" in message and "--device cuda" in message


@pytest.mark.parametrize("cli, env, source", [
    ({"conform_device": "cuda"}, {}, "--device"),
    ({}, {"CONFORM_DEVICE": "cuda"}, "CONFORM_DEVICE"),
])
def test_cuda_without_a_gpu_is_refused(cli, env, source):
    message = settings_error(cli, env, gpus=0)
    assert source in message
    assert "--device cpu" in message


def test_non_integer_world_size_from_environment_names_the_variable():
    message = settings_error(env={"CONFORM_WORLD_SIZE": "two"})
    assert "CONFORM_WORLD_SIZE" in message
    assert "'two'" in message
    assert "integer" in message


@pytest.mark.parametrize("cli, source", [
    ({"conform_world_size": "0"}, "--world-size"),
    ({"conform_world_size": "2.5"}, "--world-size"),
    ({"conform_extra_world_size": "-1"}, "--extra-world-size"),
    ({"conform_hypothesis_examples": "-3"}, "--hypothesis-examples"),
    ({"conform_case_timeout": "soon"}, "--case-timeout"),
    ({"conform_backend": "mpi"}, "--backend"),
    ({"conform_device": "tpu"}, "--device"),
])
def test_invalid_values_name_their_flag(cli, source):
    (value,) = cli.values()
    message = settings_error(cli)
    assert source in message
    assert repr(value) in message


@pytest.mark.parametrize("value", ["-5", "0"])
def test_non_positive_case_timeout_is_refused(value):
    message = settings_error(env={"CONFORM_CASE_TIMEOUT": value})
    assert "CONFORM_CASE_TIMEOUT" in message
    assert "positive" in message


def test_nan_case_timeout_is_refused():
    # NaN passes `timeout <= 0`, but no case can be timed against it.
    message = settings_error(cli={"conform_case_timeout": "nan"})
    assert "--case-timeout" in message


# -- world sizes ------------------------------------------------------------------------------


def make(world_size=2, extra=3, device="cpu", gpus=0) -> Settings:
    return Settings(hooks=(), builtins=True, entry_points=True, world_size=world_size, extra_world_size=extra,
                    backend="gloo" if device == "cpu" else "nccl", device=device, case_timeout_s=60.0,
                    hypothesis_examples=6, known_failures=(), gpu_count=gpus)


@pytest.mark.parametrize("world_size, extra, expected", [
    (2, 3, (2, 3)),
    (4, 3, (4, 3)),
    (2, None, (2,)),
    (3, 3, (3,)),   # the same size is not run twice
    (1, 2, (1, 2)),
])
def test_world_sizes_are_the_main_size_then_a_distinct_extra(world_size, extra, expected):
    assert make(world_size, extra).world_sizes == expected


def test_world_size_larger_than_the_gpu_count_is_unavailable_on_cuda():
    s = make(world_size=2, extra=3, device="cuda", gpus=2)
    assert s.world_size_unavailable(2) is None
    why = s.world_size_unavailable(3)
    assert why is not None and "3 GPUs" in why and "has 2" in why


def test_every_world_size_is_available_on_cpu():
    s = make(device="cpu", gpus=0)
    assert [s.world_size_unavailable(ws) for ws in (1, 2, 3, 17)] == [None] * 4


def test_two_gpu_machine_keeps_the_default_extra_size_but_marks_it_unavailable():
    s = settings(gpus=2)
    assert s.world_sizes == (2, 3)
    assert s.world_size_unavailable(2) is None
    assert s.world_size_unavailable(3) is not None


def test_rerun_args_reproduce_the_run_over_the_environment():
    s = settings(cli={"conform_world_size": "3"})
    dest_of = {o.flag: o.dest for o in OPTIONS}
    cli = {}
    args = s.rerun_args()
    for flag, value in zip(args[::2], args[1::2]):
        cli[dest_of[flag]] = value
    again = settings(cli=cli, env={"CONFORM_WORLD_SIZE": "9", "CONFORM_DEVICE": "cuda"})
    assert (again.world_size, again.backend, again.device) == (s.world_size, s.backend, s.device) == (3, "gloo", "cpu")


# -- the conform command ------------------------------------------------------------------------


@pytest.mark.cli  # a child interpreter: seconds, for torch and pytest's plugins
def test_cli_world_size_zero_is_a_usage_error_naming_the_flag():
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_")}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "conformance", "--world-size", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output
    assert "--world-size" in output
    assert "'0'" in output


# -- bounds: a world size this machine cannot hold is refused before anything spawns ----


GIB = 2**30


def test_a_cpu_world_size_beyond_the_memory_is_refused_with_the_largest_that_fits():
    per_rank = CPU_RANK_MEMORY_BYTES
    memory = 40 * per_rank + per_rank // 2  # room for 40 ranks in all
    with pytest.raises(SettingsError) as info:
        resolve(getoption(conform_world_size="1000"), {}, 0, cores=64, memory=memory)
    msg = str(info.value)
    assert "world size 1000 from --world-size" in msg
    assert f"about {per_rank // 2**20} MB" in msg and "is available" in msg
    # 40 ranks in all, and the extra pool of 3 starts too: at most 37 in the main pool.
    assert "at most 37" in msg and "Nothing was started" in msg
    assert resolve(getoption(conform_world_size="37"), {}, 0, cores=64, memory=memory).world_size == 37


def test_a_cpu_world_size_beyond_the_cores_is_refused_and_names_the_environment_variable():
    with pytest.raises(SettingsError) as info:
        resolve(getoption(), {"CONFORM_WORLD_SIZE": "40"}, 0, cores=2, memory=None)
    msg = str(info.value)
    # 16 ranks per core on 2 cores, less the extra pool of 3
    assert "from CONFORM_WORLD_SIZE" in msg and "2 core(s)" in msg and "at most 29" in msg


def test_world_sizes_that_fit_are_accepted():
    s = resolve(getoption(conform_world_size="8"), {}, 0, cores=2, memory=24 * GIB)
    assert s.world_sizes == (8, 3)


def test_gpu_world_sizes_are_bounded_by_the_gpus_not_the_cpu_memory():
    s = resolve(getoption(), {}, 8, cores=2, memory=1 * GIB)
    assert (s.device, s.world_size) == ("cuda", 8)


def test_the_bound_is_measured_against_this_machine_by_default():
    assert settings().world_size == 2  # the default run fits on the project's 2-core machine


# -- one GPU: never a verdict from one rank -----------------------------------------------


def test_one_gpu_default_adds_gloo_cpu_pools_at_two_and_three():
    s = settings(gpus=1)
    assert (s.backend, s.device, s.world_size) == ("nccl", "cuda", 1)
    assert s.cpu_pools == (2, 3)
    assert s.world_sizes == (1, 2, 3)
    assert s.placement(1) == ("nccl", "cuda")
    assert s.placement(2) == ("gloo", "cpu") and s.placement(3) == ("gloo", "cpu")
    assert all(s.world_size_unavailable(ws) is None for ws in s.world_sizes)
    # world size 2 gets the full plan (it is where averaging is checked); 3 the extra one
    assert [s.role(ws) for ws in s.world_sizes] == ["main", "main", "extra"]
    # A larger pool a case needs (4 ranks: subgroups, HSDP) runs on the CPU too, as on a CPU machine.
    assert s.placement(4) == ("gloo", "cpu") and s.world_size_unavailable(4) is None
    assert s.rerun_args(4)[:8] == ["--world-size", "4", "--extra-world-size", "0", "--backend", "gloo",
                                   "--device", "cpu"]


def test_one_gpu_without_extra_world_size_still_checks_two_ranks():
    s = settings(cli={"conform_extra_world_size": "0"}, gpus=1)
    assert s.world_sizes == (1, 2) and s.cpu_pools == (2,)


def test_an_explicit_world_size_one_adds_no_pools():
    s = settings(cli={"conform_world_size": "1"}, gpus=1)
    assert s.cpu_pools == () and s.world_sizes == (1, 3)
    assert s.world_size_unavailable(3) is not None  # 3 ranks need 3 GPUs


def test_several_gpus_add_no_cpu_pools():
    s = settings(gpus=2)
    assert s.cpu_pools == () and s.world_sizes == (2, 3)
    assert s.placement(3) == ("nccl", "cuda")


def test_rerun_of_a_case_on_an_added_cpu_pool_runs_it_on_gloo_cpu():
    s = settings(gpus=1)
    assert s.rerun_args(2)[:8] == ["--world-size", "2", "--extra-world-size", "0", "--backend", "gloo",
                                   "--device", "cpu"]
    assert s.rerun_args(1)[:8] == ["--world-size", "1", "--extra-world-size", "3", "--backend", "nccl",
                                   "--device", "cuda"]


# -- depth ------------------------------------------------------------------------------


def test_nightly_depth_gives_every_world_size_the_full_plan_and_200_examples():
    default, nightly = settings(), settings(env={"CONFORM_DEPTH": "nightly"})
    assert (default.depth, default.nightly, default.hypothesis_examples) == ("default", False, 3)
    assert [default.role(ws) for ws in default.world_sizes] == ["main", "extra"]
    assert (nightly.depth, nightly.hypothesis_examples) == ("nightly", 200)
    assert [nightly.role(ws) for ws in nightly.world_sizes] == ["main", "main"]
    args = nightly.rerun_args()  # a re-run of a nightly-only case must plan it again
    assert args[args.index("--depth") + 1] == "nightly" and "--hypothesis-examples" not in args
    assert "--depth" not in default.rerun_args()


def test_explicit_hypothesis_examples_win_over_the_depth():
    s = settings(cli={"conform_depth": "nightly", "conform_hypothesis_examples": "7"})
    assert s.hypothesis_examples == 7
    args = s.rerun_args()
    assert args[args.index("--hypothesis-examples") + 1] == "7"
    args = settings(cli={"conform_hypothesis_examples": "200"}).rerun_args()
    assert args[args.index("--hypothesis-examples") + 1] == "200" and "--depth" not in args


def test_a_bad_depth_names_its_source_and_the_choices():
    msg = settings_error(env={"CONFORM_DEPTH": "weekly"})
    assert "'weekly' from CONFORM_DEPTH" in msg and "default, nightly" in msg


def test_compiled_ddp_is_off_unless_asked_and_the_rerun_carries_it():
    assert not settings().with_compiled_ddp and "--with-compiled-ddp" not in settings().rerun_args()
    s = settings(env={"CONFORM_WITH_COMPILED_DDP": "1"})
    assert s.with_compiled_ddp and "--with-compiled-ddp" in s.rerun_args()


# -- strict known failures (the nightly gate) ---------------------------------------------


@pytest.mark.parametrize("env_value, expected", [("1", True), ("true", True), ("0", False), ("no", False)])
def test_strict_known_failures_from_the_environment(env_value, expected):
    assert settings(env={"CONFORM_STRICT_KNOWN_FAILURES": env_value}).strict_known_failures is expected


def test_strict_known_failures_flag_and_a_bad_environment_value():
    assert settings(cli={"conform_strict_known_failures": True}).strict_known_failures
    assert not settings().strict_known_failures
    msg = settings_error(env={"CONFORM_STRICT_KNOWN_FAILURES": "maybe"})
    assert "'maybe' from CONFORM_STRICT_KNOWN_FAILURES" in msg


def test_hypothesis_seed_is_hypothesis_own_option_and_the_rerun_command_carries_it():
    s = resolve(getoption(**{HYPOTHESIS_SEED_DEST: "7"}), {}, 0)
    assert s.hypothesis_seed == "7"
    args = s.rerun_args()
    assert args[args.index("--hypothesis-seed") + 1] == "7"
    assert "--hypothesis-seed" not in resolve(getoption(), {}, 0).rerun_args()


def test_a_disabled_hypothesis_plugin_leaves_the_seed_unset():
    def no_hypothesis(dest):
        if dest == HYPOTHESIS_SEED_DEST:
            raise ValueError("no option named 'hypothesis_seed'")
        return getoption()(dest)

    assert resolve(no_hypothesis, {}, 0).hypothesis_seed == ""


# -- rank output and rank memory --------------------------------------------------------


@pytest.mark.parametrize("dest, env_name, attr, default_mib", [
    ("conform_rank_log_limit", "CONFORM_RANK_LOG_LIMIT", "rank_log_limit_bytes", DEFAULT_RANK_LOG_LIMIT_MIB),
    ("conform_rank_memory_growth", "CONFORM_RANK_MEMORY_GROWTH", "rank_memory_growth_bytes",
     DEFAULT_RANK_MEMORY_GROWTH_MIB),
])
def test_rank_limits_are_mib_from_the_command_line_then_the_environment(dest, env_name, attr, default_mib):
    assert getattr(settings(cli={dest: "0.5"}, env={env_name: "3"}), attr) == 2**19
    assert getattr(settings(env={env_name: "3"}), attr) == 3 * 2**20
    assert getattr(settings(), attr) == int(default_mib * 2**20)


@pytest.mark.parametrize("cli, env, source", [
    ({"conform_rank_log_limit": "0"}, {}, "--rank-log-limit"),       # nothing kept would hide every traceback
    ({}, {"CONFORM_RANK_LOG_LIMIT": "lots"}, "CONFORM_RANK_LOG_LIMIT"),
    ({"conform_rank_memory_growth": "-1"}, {}, "--rank-memory-growth"),
    ({}, {"CONFORM_RANK_MEMORY_GROWTH": "inf"}, "CONFORM_RANK_MEMORY_GROWTH"),
])
def test_invalid_rank_limits_name_their_source(cli, env, source):
    message = settings_error(cli, env)
    assert source in message and "MiB" in message


def test_rank_memory_growth_zero_turns_the_check_off():
    assert settings(cli={"conform_rank_memory_growth": "0"}).rank_memory_growth_bytes == 0


def test_cpu_ranks_see_no_gpu_and_gpu_ranks_see_theirs(monkeypatch):
    """A one-GPU machine's cross-rank pools run on the CPU: their ranks must see no GPU, as on a CPU machine
    (PyTorch's own hooks take CUDA paths whenever CUDA is available); the NCCL pool's ranks keep the GPUs."""
    from conformance.controller.pool import PoolConfig, pool_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    one_gpu = settings(gpus=1)
    cpu = pool_env(PoolConfig(world_size=2, backend=one_gpu.placement(2)[0], device=one_gpu.placement(2)[1]))
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    if sys.platform.startswith("linux"):
        assert cpu["GLOO_SOCKET_IFNAME"] == "lo"
    gpu = pool_env(PoolConfig(world_size=1, backend=one_gpu.placement(1)[0], device=one_gpu.placement(1)[1]))
    assert gpu["CUDA_VISIBLE_DEVICES"] == "0"
    assert gpu.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")  # NCCL's pool: left as it was
