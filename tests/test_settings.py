"""Tests for conformance.controller.settings: command line > environment > machine default, and the errors.

``resolve`` is fed a fake ``getoption`` (``tests/settings_helpers.py``) that answers like pytest does for options
nobody gave, an explicit environment and an explicit GPU count, so no test depends on this machine. The world
sizes a machine holds are in ``tests/test_settings_world_sizes.py``; the depth and what a re-run carries in
``tests/test_settings_nightly.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.controller.options import (DEFAULT_HYPOTHESIS_EXAMPLES, DEFAULT_RANK_LOG_LIMIT_MIB,
                                            DEFAULT_RANK_MEMORY_GROWTH_MIB, HYPOTHESIS_SEED_DEST, OPTIONS)
from tests.settings_helpers import DESTS, settings, settings_error

REPO = Path(__file__).resolve().parents[1]


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
