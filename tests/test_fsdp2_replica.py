"""The fsdp2_replica API's controller side: its specs, its case plans and its mesh shapes."""

from __future__ import annotations

import pytest

from conformance import HookSpec, LossyContract
from conformance.apis.fsdp2_replica.builtin_hooks import REPLICA_HOOKS, replica_avg_all_reduce, replica_group_state
from conformance.apis.fsdp2_common.setup import replica_shape
from conformance.apis.fsdp2_replica.plan import ODD_REPLICA_WORLD_SIZE
from conformance.apis.registry import HOOK_APIS, planned_cases
from conformance.signatures import SpecError
from tests.meta_helpers import plan_settings

API = HOOK_APIS["fsdp2_replica"]


def test_mesh_shapes_keep_two_shards_and_make_the_rest_replicas():
    assert replica_shape(4) == (2, 2)
    assert replica_shape(ODD_REPLICA_WORLD_SIZE) == (3, 2)
    assert replica_shape(2) == (2, 1)  # the long run's: 2 replicas of 1 shard
    for bad in (3, 5):
        with pytest.raises(ValueError, match="even world size of at least 4"):
            replica_shape(bad)


def test_a_hook_is_called_with_its_state_and_the_tensor_and_claims_exactness():
    """HookSpec validates against its API on construction."""
    HookSpec(name="two_args", api="fsdp2_replica", hook=replica_avg_all_reduce, state=replica_group_state)
    with pytest.raises(SpecError, match=r"hook\(state, tensor\)"):
        HookSpec(name="one_arg", api="fsdp2_replica", hook=lambda tensor: None, state=replica_group_state)
    with pytest.raises(SpecError, match="cannot declare a LossyContract"):
        HookSpec(name="lossy", api="fsdp2_replica", hook=replica_avg_all_reduce, state=replica_group_state,
                 lossy=LossyContract(rel_error_bound=0.1))


def test_default_run_plans_every_check_on_the_four_rank_pool_and_six_only_when_asked():
    spec = REPLICA_HOOKS[0]
    for test in (t for t in API.plans if "long_run" not in t and "switches" not in t):
        cases = planned_cases(test, [spec], plan_settings(2, 3))
        # accumulation also under set_requires_all_reduce(False), which FSDP2 does not apply to the hook
        configs = {"replica", "all_reduce_off"} if "accumulation" in test else {"replica"}
        assert cases and {c.world_size for c in cases} == {4} and {c.variant for c in cases} == configs
        assert all(c.skip is None for c in cases)
        # With a 6-rank pool (3 replicas x 2 shards) the cases run there, where dividing before the SUM rounds.
        wider = planned_cases(test, [spec], plan_settings(2, ODD_REPLICA_WORLD_SIZE))
        assert {c.world_size for c in wider} == {ODD_REPLICA_WORLD_SIZE}
        both = planned_cases(test, [spec], plan_settings(4, ODD_REPLICA_WORLD_SIZE))
        assert {c.world_size for c in both} == {4, ODD_REPLICA_WORLD_SIZE}


def test_the_long_run_trains_on_two_replicas_of_one_shard_across_two_nodes():
    (case,) = planned_cases("test_fsdp2_replica_long_run", [REPLICA_HOOKS[0]], plan_settings(2, 3))
    assert (case.world_size, case.nodes, case.model) == (2, 2, "net_flat") and case.skip is None
    nightly = planned_cases("test_fsdp2_replica_long_run", [REPLICA_HOOKS[0]], plan_settings(2, 3, depth="nightly"))
    assert {c.world_size for c in nightly} == {2, 4}
    parity = planned_cases("test_fsdp2_replica_parity", [REPLICA_HOOKS[0]], plan_settings(2, 3, depth="nightly"))
    assert {(c.world_size, c.nodes) for c in parity} == {(4, 2), (ODD_REPLICA_WORLD_SIZE, 3), (8, 2)}


def test_a_reference_built_to_sync_always_ignores_the_accumulation_setter():
    """``all_reduce_off``: the hooked model gets set_requires_all_reduce(False) on a micro-batch, the reference
    (native HSDP) nothing, as FSDP2 calls the hook on every micro-batch whatever that setter says."""
    from torch import nn

    from conformance.apis.fsdp2_common.models import Fsdp2Models
    from conformance.apis.fsdp2_replica.standalone import SETUP

    class Models(Fsdp2Models):
        setup = SETUP

    class Model(nn.Module):
        def __init__(self, always):
            super().__init__()
            self.conformance_syncs_always = always
            self.calls = []

        def set_requires_all_reduce(self, value):
            self.calls.append(value)

    models = Models.__new__(Models)
    models.layout = SETUP.configs["all_reduce_off"]
    hooked, reference = Model(False), Model(True)
    for model in (hooked, reference):
        with models.no_sync(model):
            pass
    assert (hooked.calls, reference.calls) == ([False, True], [])
