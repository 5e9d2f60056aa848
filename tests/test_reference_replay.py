"""Every check the runner replays with ``reference_only=True`` trains its reference alone, hook untouched.

The runner tells "PyTorch cannot run the suite's reference here" (a skip) from
"the hook broke it" (a failure) by replaying a failed case with
``reference_only=True`` (``conformance.controller.replays.replay``). That
replay must never build the hooked model or call anything of the hook's: if it
did, a hook that raises would turn its own failure into a skip. Each check of
``conformance.controller.replays.REPLAYS_REFERENCE`` runs here on a one-rank gloo group with
a spec whose hook, state and comm all raise.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import inspect

from conformance.controller.replays import DEFAULT_HOOK_REPLAYABLE, REFERENCE_REPLAYABLE, REPLAYS_REFERENCE
from conformance.ranks.checks import get_rank_check
from conformance.ranks.checks.common import SHARED_CHECKS
from conformance.protocol import REFERENCE_DIGEST
from conformance.spec import HookSpec
from conformance.ranks.worker import RankContext


class HookTouched(AssertionError):
    pass


def _raises(*args, **kwargs):
    raise HookTouched("the reference-only replay called the hook under test")


def _fsdp_hook(state, grad, output=None):
    _raises()


#: check -> (the spec's API, the check's parameters).
CASES = {
    "fsdp.parity": ("fsdp", {"strategy": "FULL_SHARD", "model": "nested_wrapped"}),
    "fsdp.clip_grad_norm": ("fsdp", {"strategy": "FULL_SHARD", "model": "nested_wrapped"}),
    "ddp.parity": ("ddp", {"config": "default", "model": "nested_wrapped"}),
    "ddp.clip_grad_norm": ("ddp", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2.parity": ("fsdp2", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2.clip_grad_norm": ("fsdp2", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2_all_gather.parity": ("fsdp2_all_gather", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2_all_gather.clip_grad_norm": ("fsdp2_all_gather", {"config": "default", "model": "nested_wrapped"}),
    # the long runs, a few steps of their regression (their own objective)
    "ddp.long_run": ("ddp", {"config": "default", "model": "net_flat", "steps": 3}),
    "fsdp.long_run": ("fsdp", {"strategy": "FULL_SHARD", "model": "net_flat", "steps": 3}),
    "fsdp2.long_run": ("fsdp2", {"config": "default", "model": "net_flat", "steps": 3}),
    "fsdp2_all_gather.long_run": ("fsdp2_all_gather", {"config": "default", "model": "net_flat", "steps": 3}),
    # the second model: its reference alone (the first model is hooked, so the replay builds neither)
    "fsdp.second_model": ("fsdp", {"strategy": "FULL_SHARD", "model": "nested_wrapped"}),
    "ddp.second_model": ("ddp", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2.second_model": ("fsdp2", {"config": "default", "model": "nested_wrapped"}),
    "fsdp2_all_gather.second_model": ("fsdp2_all_gather", {"config": "default", "model": "nested_wrapped"}),
}
#: Replayed too, but only on an HSDP mesh of 4 ranks: :func:`test_all_reduce_hook_replay_trains_native_hsdp_alone`.
ON_FOUR_RANKS = {"fsdp2_all_reduce.parity": ("fsdp2_all_reduce", {"config": "hsdp", "model": "nested_wrapped"}),
                 "fsdp2_replica.parity": ("fsdp2_replica", {"config": "replica", "model": "nested_wrapped"}),
                 "fsdp2_all_reduce.long_run": ("fsdp2_all_reduce", {"config": "replicate", "model": "net_flat",
                                                                    "steps": 3}),
                 "fsdp2_replica.long_run": ("fsdp2_replica", {"config": "replica", "model": "net_flat", "steps": 3}),
                 "fsdp2_all_reduce.second_model": ("fsdp2_all_reduce", {"config": "hsdp", "model": "nested_wrapped"}),
                 "fsdp2_replica.second_model": ("fsdp2_replica", {"config": "replica", "model": "nested_wrapped"})}


def test_every_replayed_check_is_covered():
    assert set(CASES) | set(ON_FOUR_RANKS) == set(REPLAYS_REFERENCE)


def test_the_controllers_replay_policy_names_shared_checks_that_can_replay():
    """The controller's policy names the rank side's shared checks, and those it replays with the reference
    alone take ``reference_only`` (a name there without it would fail the replay with a TypeError)."""
    assert REFERENCE_REPLAYABLE <= set(SHARED_CHECKS) and DEFAULT_HOOK_REPLAYABLE <= set(SHARED_CHECKS)
    takes = {name for name, run in SHARED_CHECKS.items() if "reference_only" in inspect.signature(run).parameters}
    assert takes == REFERENCE_REPLAYABLE


@pytest.mark.parametrize("low_precision_grads", [False, True])
def test_fsdp_low_precision_clip_replays_too(gloo_group, low_precision_grads):
    """The float16 clip case (MixedPrecision(param_dtype=float16)) replays its own reference."""
    phases = _replay(gloo_group, "fsdp.clip_grad_norm", "fsdp", {**CASES["fsdp.clip_grad_norm"][1],
                                                            "low_precision_grads": low_precision_grads})
    assert any("clip_grad_norm_" in p for p in phases), phases


@pytest.mark.parametrize("check", sorted(CASES))
def test_reference_only_trains_the_reference_alone(gloo_group, check):
    api, params = CASES[check]
    phases = _replay(gloo_group, check, api, params)
    assert any("reference" in p for p in phases), phases
    assert not [p for p in phases if "hooked" in p], phases


def _replay(group, check, api, params, rank=0, world_size=1):
    hook = _fsdp_hook if api == "fsdp" else _raises
    spec = HookSpec(name="raises", api=api, hook=hook,
                    state=_raises if api in ("fsdp", "ddp", "fsdp2_replica") else None)
    phases = []

    class Recording(RankContext):
        def phase(self, text):
            phases.append(text)
            super().phase(text)

    ctx = Recording(rank, world_size, group, torch.device("cpu"), "gloo")
    result = get_rank_check(check)(ctx, spec, reference_only=True, **params)
    assert result.findings == [] and len(result.figures[REFERENCE_DIGEST]) == 16, result
    again = get_rank_check(check)(ctx, spec, reference_only=True, **params)
    assert again.figures == result.figures, "native trained twice here must keep its bits"
    return phases


def _replay_on_four_ranks(rank, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    try:
        for check, (api, params) in ON_FOUR_RANKS.items():
            phases = _replay(dist.group.WORLD, check, api, params, rank=rank, world_size=4)
            assert any("reference" in p for p in phases), phases
            assert not [p for p in phases if "hooked" in p], phases
        # Every rank done before any tears its group down: a rank that destroyed it while a peer's last
        # collective was still in flight aborted that peer ('terminate called without an active exception').
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_all_reduce_hook_replay_trains_native_hsdp_alone(tmp_path):
    """An all-reduce hook's parity, and a replica hook's, replay their reference, native HSDP on a 2x2 mesh,
    without the hook."""
    from conformance.apis.fsdp2_common.build import missing_api

    why = missing_api(("set_all_reduce_hook",))
    if why is not None:
        pytest.skip(why)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_replay_on_four_ranks, args=(str(tmp_path / "store"),), nprocs=4, join=True)


def test_clip_without_backward_is_a_float32_zero(gloo_group):
    """The no-gradient step of the FSDP clip check sees what PyTorch's test_no_gradients asserts: a float32
    zero. (At one rank FSDP falls back to NO_SHARD and to torch.nn.utils.clip_grad_norm_, which does not
    warn; the sharded path's "with no gradients" warning is compared between the models at 2 ranks.)"""
    from conformance.apis.fsdp.models import build_fsdp
    from conformance.apis.fsdp.standalone import low_precision_grads_mixed_precision
    from conformance.models import get_model
    from conformance.ranks.checks.clip import clip_without_backward

    ctx = RankContext(0, 1, gloo_group, torch.device("cpu"), "gloo")
    model = build_fsdp("nested_wrapped", ctx, "FULL_SHARD", mixed_precision=low_precision_grads_mixed_precision())
    inputs = get_model("nested_wrapped").make_input(0, 1, ctx.device)
    norm, warned = clip_without_backward(ctx, model, "reference", inputs, lambda m: m.clip_grad_norm_(1.0))
    assert norm.dtype == torch.float32 and norm.tolist() == [0.0]
    assert all(p.grad is None for p in model.parameters())
    assert warned == []
