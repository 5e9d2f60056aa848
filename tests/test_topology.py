"""The node layouts a case simulates: torchrun's variables per rank, set for the case and put back after.

``conformance.ranks.topology`` mirrors torch.distributed.elastic's assignment for a homogeneous job (node ``n``
holds global ranks ``n * local ... (n + 1) * local - 1``); the reproducers carry a torch-only copy
(``standalone_launch.layout_env``), which must say the same.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.cases import CaseParams, case_id, parse_case_id
from conformance.ranks import topology
from conformance.shared.standalone_launch import layout_env
from conformance.reports.report import header


@pytest.mark.parametrize("world_size,nodes,rank,expected", [
    (4, 2, 0, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}),
    (4, 2, 3, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}),
    (2, 2, 1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}),
    (8, 2, 5, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}),
    (3, 1, 2, {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}),
])
def test_torchrun_env_lays_ranks_out_node_by_node(world_size, nodes, rank, expected):
    env = topology.torchrun_env(rank, world_size, nodes)
    assert {k: env[k] for k in expected} == expected
    assert (env["RANK"], env["WORLD_SIZE"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == (
        str(rank), str(world_size), str(rank), str(world_size))
    assert set(env) == set(topology.TORCHRUN_LAYOUT_VARIABLES)
    assert topology.nodes_of_env(env) == nodes


@given(nodes=st.integers(1, 4), local=st.integers(1, 4), data=st.data())
def test_the_reproducers_copy_of_the_layout_agrees(nodes, local, data):
    world_size = nodes * local
    rank = data.draw(st.integers(0, world_size - 1))
    mine = layout_env(rank, world_size, nodes)
    assert mine == {k: v for k, v in topology.torchrun_env(rank, world_size, nodes).items() if k in mine}


def test_a_layout_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="cannot be laid out as 2 nodes"):
        topology.torchrun_env(0, 3, 2)
    with pytest.raises(ValueError, match="3 ranks cannot be laid out as 2 nodes"):
        CaseParams("h", "default", 3, model="m", api="ddp", check="parity", variant_field="config", nodes=2)


def test_simulated_sets_the_variables_for_the_block_and_puts_back_what_was_there(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    with topology.simulated({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}):
        assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]) == ("2", "1")
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and "GROUP_RANK" not in os.environ
    with pytest.raises(RuntimeError), topology.simulated({"GROUP_RANK": "1"}):
        raise RuntimeError("the case raised")
    assert "GROUP_RANK" not in os.environ


def test_a_multi_node_case_says_so_in_its_id_and_its_failure():
    case = CaseParams("h", "default", 4, model="nested_wrapped", api="ddp", check="parity", variant_field="config",
                      nodes=2)
    assert case.id == "h-default-nested_wrapped-2nodes-ws4" == case_id("h", "default", model="nested_wrapped",
                                                                         world_size=4, nodes=2)
    assert parse_case_id(f"test_ddp_parity[{case.id}]") == {"hook": "h", "variant": "default",
                                                            "detail": "nested_wrapped", "nodes": 2, "world_size": 4}
    assert ("nodes", 2) in case.junit_properties() and case.describe()["nodes"] == 2
    first, layout = header("h", case.describe(), 4).splitlines()
    assert first.endswith("nodes=2 world_size=4")
    assert "2 nodes of 2 ranks" in layout and "LOCAL_WORLD_SIZE=2" in layout and "GROUP_WORLD_SIZE=2" in layout
    one = CaseParams("h", "default", 4, model="nested_wrapped", api="ddp", check="parity", variant_field="config")
    assert "nodes" not in one.id and len(header("h", one.describe(), 4).splitlines()) == 1


def test_the_worker_simulates_only_a_case_of_several_nodes():
    from conformance.protocol import Case
    from conformance.ranks.worker import _Worker

    worker = _Worker.__new__(_Worker)
    worker.rank, worker.world_size = 3, 4
    assert worker.case_layout(Case("ddp.parity", None, {})) == {}
    layout = worker.case_layout(Case("ddp.parity", None, {}, nodes=2))
    assert layout == topology.torchrun_env(3, 4, 2) and layout["GROUP_RANK"] == "1"


def test_under_listen_the_layout_reported_is_torchruns_own():
    """torchrun's ranks say their node (GROUP_RANK) when they join; the pool's nodes are how many there are,
    which replace a case's own in its reach (``conformance.reports.reach.note_reach``)."""
    from conformance.controller.remote import RemotePool

    pool = RemotePool.__new__(RemotePool)
    pool._info = []
    assert pool.nodes is None  # no rank joined yet
    pool._info = [{"group_rank": 0}, {"group_rank": 0}, {"group_rank": 1}, {"group_rank": 1}]
    assert pool.nodes == 2
