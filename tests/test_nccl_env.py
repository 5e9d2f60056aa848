"""NCCL pinned, and recorded: the environment the suite gives its NCCL ranks, checked without a GPU.

On NCCL a reduction's bits depend on the algorithm, protocol and channel count NCCL picks by message size and
topology; the suite pins them (``NCCL_PINNED``, torchtitan's batch-invariant set) in every NCCL rank before its
first communicator, each unless the user's environment sets it, and records the NCCL version and every ``NCCL_*``
variable in the JSON and the Markdown. A gloo run touches none of it.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from conformance.ranks import worker
from conformance.reports.markdown_summary import _environment_line
from conformance.shared.nccl import nccl_record
from conformance.shared.standalone_launch import NCCL_PINNED, pin_nccl


@pytest.fixture
def no_nccl_env(monkeypatch):
    """This process's environment with no ``NCCL_*`` variable, put back after the test."""
    for name in [n for n in os.environ if n.startswith("NCCL_")] + list(NCCL_PINNED):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_pinned_set_fixes_algorithm_protocol_channels_and_turns_nvls_and_collnet_off():
    assert NCCL_PINNED == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1",
                           "NCCL_MAX_NCHANNELS": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}


def test_pinning_keeps_every_variable_the_user_set():
    env = {"NCCL_ALGO": "Tree", "NCCL_DEBUG": "INFO", "PATH": "/bin"}
    pinned = pin_nccl(env)
    assert env["NCCL_ALGO"] == "Tree" and env["NCCL_DEBUG"] == "INFO" and env["PATH"] == "/bin"
    assert pinned == {k: v for k, v in NCCL_PINNED.items() if k != "NCCL_ALGO"}
    assert {k: env[k] for k in NCCL_PINNED} == {**NCCL_PINNED, "NCCL_ALGO": "Tree"}
    assert pin_nccl(env) == {}, "pinning twice sets nothing more"


def test_the_record_names_the_version_every_variable_and_who_set_each():
    assert nccl_record("gloo", {"NCCL_ALGO": "Tree"}) is None
    record = nccl_record("nccl", {"NCCL_ALGO": "Tree", "NCCL_IB_HCA": "mlx5_0", "OTHER": "x"},
                         version=lambda: "2.21.5")
    assert record["version"] == "2.21.5"
    assert record["variables"] == {**NCCL_PINNED, "NCCL_ALGO": "Tree", "NCCL_IB_HCA": "mlx5_0"}
    assert list(record["variables"]) == sorted(record["variables"])
    assert record["set_by_user"] == ["NCCL_ALGO"]
    assert record["pinned_by_suite"] == sorted(set(NCCL_PINNED) - {"NCCL_ALGO"})


def test_a_torch_without_nccl_records_no_version(no_nccl_env):
    record = nccl_record("nccl")
    assert record["variables"] == NCCL_PINNED and "NCCL_ALGO" not in os.environ  # the controller's own: untouched
    assert record["version"] is None or record["version"].count(".") == 2


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_rank_pins_nccl_before_it_joins_its_process_group_and_only_on_nccl(no_nccl_env, backend):
    no_nccl_env.setenv("NCCL_PROTO", "LL128")  # the user's choice
    seen = []
    no_nccl_env.setattr(dist, "init_process_group", lambda **kwargs: seen.append(
        (kwargs, {k: v for k, v in os.environ.items() if k.startswith("NCCL_")})))
    worker.join_process_group({"backend": backend, "rank": 0, "world_size": 1})
    [(kwargs, env)] = seen
    assert kwargs == {"backend": backend, "rank": 0, "world_size": 1}
    if backend == "nccl":
        assert env == {**NCCL_PINNED, "NCCL_PROTO": "LL128"}
    else:
        assert env == {"NCCL_PROTO": "LL128"}


def test_the_markdown_environment_line_names_nccl_and_the_variables_the_suite_set():
    doc = {"environment": {"torch_version": "2.11.0+cu130", "torch_build": "cuda", "backend": "nccl",
                           "device": "cuda", "world_sizes": [8],
                           "nccl": nccl_record("nccl", {"NCCL_ALGO": "Tree"}, version=lambda: "2.27.3")},
           "run": {"exit_status": 0}}
    line = _environment_line(doc)
    assert "backend nccl · NCCL 2.27.3 (NCCL_ALGO=Tree, NCCL_COLLNET_ENABLE=0 (suite)," in line, line
    assert "NCCL_PROTO=Simple (suite)" in line
    doc["environment"].update(backend="gloo", device="cpu", nccl=None)
    assert "NCCL" not in _environment_line(doc)
