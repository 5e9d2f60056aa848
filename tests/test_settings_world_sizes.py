"""Tests for conformance.controller.settings' world sizes: the main size and a distinct extra one, which a
machine can hold (GPUs, CPU cores and memory, refused before anything spawns), and a one-GPU machine's gloo
pools on the CPU (never a verdict from one rank), whose ranks see no GPU.
"""

from __future__ import annotations

import os
import sys

import pytest

from conformance.controller.settings import Settings, resolve
from conformance.controller.options import OPTIONS, SettingsError
from conformance.controller.capacity import CPU_RANK_MEMORY_BYTES
from tests.settings_helpers import getoption, settings


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


def test_cpu_ranks_see_no_gpu_and_gpu_ranks_see_theirs(monkeypatch):
    """A one-GPU machine's cross-rank pools run on the CPU: their ranks must see no GPU, as on a CPU machine
    (PyTorch's own hooks take CUDA paths whenever CUDA is available); the NCCL pool's ranks keep the GPUs."""
    from conformance.controller.local_pool import pool_env
    from conformance.controller.pools import PoolConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    one_gpu = settings(gpus=1)
    cpu = pool_env(PoolConfig(world_size=2, backend=one_gpu.placement(2)[0], device=one_gpu.placement(2)[1]))
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    if sys.platform.startswith("linux"):
        assert cpu["GLOO_SOCKET_IFNAME"] == "lo"
    gpu = pool_env(PoolConfig(world_size=1, backend=one_gpu.placement(1)[0], device=one_gpu.placement(1)[1]))
    assert gpu["CUDA_VISIBLE_DEVICES"] == "0"
    assert gpu.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")  # NCCL's pool: left as it was
