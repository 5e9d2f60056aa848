"""The diagnosis of two-level reductions (within each node, then across nodes) on a simulated layout of 2 nodes of 2.

Four real gloo ranks, each with torchrun's variables of 2 nodes of 2 (as a case that simulates that layout sets
them), reduce their gradients the way a hierarchical hook does, with real subgroups: an all-reduce within the node,
then one across nodes, divided at one level, both, or neither, and FSDP1's post-divide applied to ``grad`` after the
shard went to ``output``. ``explain`` must name each by its code and its words, with the fix, and never call a
two-level reduction native. The words of each cause are held on their own, without ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conformance.apis.ddp.arithmetic import DdpArithmetic
from conformance.apis.fsdp.arithmetic import FsdpArithmetic
from conformance.ranks.diagnosis import explain
from conformance.ranks.hook_call import HookCall
from conformance.ranks.reduction import NODES, Reduction, Scale
from conformance.ranks.topology import torchrun_env

WORLD_SIZE, LOCAL = 4, 2


def _two_level(x: torch.Tensor, intra, inter, between: float = 1.0) -> torch.Tensor:
    """A hook's two-level SUM of ``x``: an all-reduce within the node, divided by ``between``, one across nodes."""
    t = x.clone()
    dist.all_reduce(t, group=intra)
    if between != 1.0:
        t.div_(between)
    dist.all_reduce(t, group=inter)
    return t


def _groups(rank: int):
    """This rank's node group and cross-node group (every rank creates every group, in the same order)."""
    intra = inter = None
    for node in range(WORLD_SIZE // LOCAL):
        ranks = list(range(node * LOCAL, (node + 1) * LOCAL))
        group = dist.new_group(ranks)
        intra = group if rank in ranks else intra
    for column in range(LOCAL):
        ranks = [node * LOCAL + column for node in range(WORLD_SIZE // LOCAL)]
        group = dist.new_group(ranks)
        inter = group if rank in ranks else inter
    return intra, inter


def _explain(arith, x, out, sharded, rank):
    call = HookCall(step=0, index=0, where="call 0", input=x.clone(), output=out, sharded=sharded)
    return explain(arith, call, None, dist.group.WORLD, rank)


def _named(causes, code, words):
    """The cause of ``code`` whose words hold ``words``, of order ``nodes`` where it has one."""
    found = [c for c in causes if c.code == code and words in c.words]
    assert found, (code, words, [(c.code, c.words) for c in causes])
    return found[0]


def _run(rank: int, store_path: str) -> None:
    os.environ.update(torchrun_env(rank, WORLD_SIZE, WORLD_SIZE // LOCAL))
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    try:
        intra, inter = _groups(rank)
        gen = torch.Generator().manual_seed(31 + rank)
        # Magnitudes that differ by rank, so the order of the sum shows in the bits (as in test_diagnosis.py).
        x = torch.randn(64, generator=gen) * 10.0 ** (2 * (rank % 2)) * (1 - 2 * (rank // 2))
        fsdp = FsdpArithmetic(WORLD_SIZE, None)  # pre-divides by 2, post-divides by 2

        # FSDP1's wrong-tensor post-divide over a two-level reduction: output keeps the SUM of x / 2.
        out = _two_level(x / 2, intra, inter).chunk(WORLD_SIZE)[rank].clone()
        causes = _explain(fsdp, x, out, True, rank)
        assert causes[0].code != "native", causes
        missing = _named(causes, "post_divide_missing", "native's pre-divide without its post-divide")
        assert missing.param("order") == NODES
        assert "summed within each node, then across nodes (2 nodes of 2 ranks), never divided by 2 after it" in \
            missing.words
        assert missing.fix.startswith("apply the post-divide to the tensor the API reads, after the SUM: write the "
                                      "reduced shard into output (FSDP reads output, not grad"), missing.fix
        assert "reduce with one dist.reduce_scatter_tensor over the hook's process group" in missing.fix

        # The same bug with FSDP's own reduce-scatter: named in the collective's order.
        flat = torch.empty(x.numel() // WORLD_SIZE)
        dist.reduce_scatter_tensor(flat, x / 2)
        causes = _explain(fsdp, x, flat, True, rank)
        assert _named(causes, "post_divide_missing", "never divided by 2 after it").param("order") != NODES

        # Averaged twice across the levels (tests/zoo/reach_hooks' bad_fsdp_two_level_avg_twice): / 2, then / 4.
        out = _two_level(x, intra, inter, between=LOCAL).div(WORLD_SIZE)
        twice = _named(_explain(fsdp, x, out, False, rank), "divided_twice", "averaged twice across the levels")
        assert "each node's sum divided by 2 (LOCAL_WORLD_SIZE or the node count)" in twice.words, twice.words
        assert twice.words.endswith("1/2 of native's average") and twice.fix.startswith("divide once: divide by")

        # A division missing at one level: each node's mean summed across nodes.
        out = _two_level(x, intra, inter, between=LOCAL)
        one = _named(_explain(fsdp, x, out, False, rank), "level_divide_missing", "the sum across nodes never divided")
        assert one.words.endswith("2 times native's average") and "LOCAL_WORLD_SIZE within the node" in one.fix

        # A correct two-level mean (DDP's 1/4 on each rank, then two levels): native's average in another order.
        ddp = DdpArithmetic(WORLD_SIZE, None)
        out = _two_level(x * (1.0 / WORLD_SIZE), intra, inter)
        causes = _explain(ddp, x, out, False, rank)
        assert "native" not in [c.code for c in causes], causes
        mean = _named(causes, "rounding_order", "summed within each node, then across nodes (2 nodes of 2 ranks)")
        assert mean.param("order") == NODES and mean.param("pre") == "reciprocal"
        assert mean.fix.startswith("reduce with one dist.all_reduce over the hook's process group, not within each "
                                   "node and then across nodes")

        # A SUM in two levels, never averaged.
        out = _two_level(x, intra, inter)
        _named(_explain(ddp, x, out, False, rank), "sum_not_averaged", "without averaging: 4 times native's average")

        # The layout adds nothing on one node, or where the hook's group is not the whole job.
        call = HookCall(step=0, index=0, where="", input=x.clone(), output=x.clone())
        assert fsdp.two_level_changes(call, fsdp.reduction(call))
        assert not FsdpArithmetic(2, None).two_level_changes(call, FsdpArithmetic(2, None).reduction(call))
        os.environ.update(torchrun_env(rank, WORLD_SIZE, 1))
        assert not fsdp.two_level_changes(call, fsdp.reduction(call))
        dist.barrier()  # every rank done before any tears the group down
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_level_reductions_on_two_nodes_of_two_are_named(tmp_path):
    """Each two-level reduction a hierarchical hook computes on 2 nodes of 2 is named, bit for bit, with its fix."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_run, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)


def _words(**kw):
    from conformance.ranks.cause_words import Words

    base = dict(world_size=4, default_world_size=4, rank=0, sharded=True, reduce_in=torch.float32,
                own=torch.float32, claim=None, describe="FSDP pre-divides by 2 and post-divides by 2",
                average="AVERAGE", group_arg="group=state.process_group", describe_as=lambda n: f"FSDP as for {n}",
                layout=(2, 2), result_goes="write the reduced shard into output")
    base.update(kw)
    return Words(**base)


def test_a_two_level_cause_is_worded_from_its_divisors_at_each_level():
    """The code says how far the divisors before, between and after the levels fall from native's; the parameters
    say how it scales at each level, never its numbers: one family whatever the layout's sizes."""
    native = Reduction(pre=(Scale(2),), post=(Scale(2),))
    nodes = replace(native.plain_sum(), order=NODES, node_size=2)
    words = _words()
    twice = words.of(native, replace(nodes, between=(Scale(2),), post=(Scale(4),)))
    assert twice.code == "divided_twice" and twice.params == (
        ("order", NODES), ("between", "divide"), ("post", "divide"))
    assert twice.words == ("averaged twice across the levels: summed within each node, then across nodes (2 nodes of "
                           "2 ranks), each node's sum divided by 2 (LOCAL_WORLD_SIZE or the node count) and the sum "
                           "across nodes divided by 4 (the world size): 1/2 of native's average")
    wide = _words(world_size=8, layout=(4, 2), describe="FSDP pre-divides by 4 and post-divides by 2")
    native8 = Reduction(pre=(Scale(4),), post=(Scale(2),))
    twice8 = wide.of(native8, replace(nodes, node_size=4, between=(Scale(4),), post=(Scale(8),)))
    assert twice8.family == twice.family and "(LOCAL_WORLD_SIZE)" in twice8.words
    mean = words.of(native, replace(nodes, between=(Scale(2),), post=(Scale(2),)))
    assert mean.code == "rounding_order" and mean.words.endswith(", where FSDP pre-divides by 2 and post-divides by 2")
    assert words.of(native, replace(nodes, post=(Scale(2),))).code == "level_divide_missing"
    assert words.of(native, nodes).code == "sum_not_averaged"
    missing = words.of(native, replace(native, order=NODES, node_size=2, post=()))
    assert missing.code == "post_divide_missing" and missing.param("order") == NODES
    flat = words.of(native, replace(native, post=()))
    assert flat.code == "post_divide_missing" and flat.words == (
        "native's pre-divide without its post-divide: divided by 2 before the SUM, never divided by 2 after it (the "
        "post-divide never reached the result the API reads): 2 times native's average, where FSDP pre-divides by 2 "
        "and post-divides by 2")
    assert flat.fix == ("apply the post-divide to the tensor the API reads, after the SUM: write the reduced shard "
                        "into output, then divide that tensor by 2; a post-divide of another tensor (the input, a "
                        "copy) never reaches the result")
    # Averaged twice in the collective's order stays what it was.
    assert words.of(native, replace(native, post=(Scale(2), Scale(4)))).code == "divided_twice"
