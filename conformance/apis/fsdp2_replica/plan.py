"""The FSDP2 replica all-reduce API (``api="fsdp2_replica"``): validation and its suite tests.

``FSDPModule.set_all_reduce_hook(hook)`` on FSDP modules under ``fully_shard``
over a 1-D shard mesh. Its docstring: the hook receives "the reduce-scatter
output if only using FSDP". FSDP2 then does no replica all-reduce of its own,
so the hook is the whole data-parallel reduction across replicas, over a
process group outside the mesh (torchft's and torchtitan's fault-tolerant HSDP
all-reduce with AVG over the replica group). The reference is native HSDP on
the 2-D (replicate x shard) mesh of the same ranks. The spec's hook is called as
``hook(state, tensor)``, ``state = spec.state(replica_group)``, and must reduce
``tensor`` in place. Its setup object is
:data:`~conformance.apis.fsdp2_replica.standalone.SETUP`; the rank side is
``models.py`` (with ``recorder.py`` and ``arithmetic.py``); what the FSDP2 APIs
share is in ``conformance/apis/fsdp2_common/``.

Suite tests (``conformance/suite/test_fsdp2_replica.py``), each a shared rank
check: ``fsdp2_replica_parity`` (``nested_wrapped``), ``fsdp2_replica_long_run`` (``net_flat``),
``fsdp2_replica_hard_inputs``
(the probe) and ``fsdp2_replica_accumulation`` (``set_requires_gradient_sync(False)``
on all micro-batches but the last), at the HSDP world size (2 replicas x 2
shards) and, in a run with a 6-rank pool (``--extra-world-size 6``), at 3
replicas x 2 shards, where dividing before the SUM rounds differently
(:func:`~conformance.apis.fsdp2_common.setup.replica_shape`); and
``fsdp2_replica_registration``, FSDP2's registration rules of ``set_all_reduce_hook``
in this setting (the API's own rank check, ``fsdp2_replica.registration``).

Only ``torch`` is imported at module level, as for the other FSDP2 APIs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, List, Sequence, Tuple

from conformance.apis import (LONG_RUN_STEPS, TWO_NODES, CasePlan, HookApi, SuiteTest, called_as,
                              simulated_layout_skip, two_node_world_sizes)
from conformance.apis.switches import switch_plan
from conformance.apis.fsdp2_common.plan import (REGISTRATION_RULES, hsdp_unavailable, hsdp_world_size, missing_api,
                                              registration_plan)
from conformance.apis.fsdp2_common.setup import REPLICA_SHARDS, replica_shape
from conformance.apis.fsdp2_replica.standalone import SETUP
from conformance.cases import CaseParams
from conformance.catalogue import CheckEntry
from conformance.models import ACCUMULATION_MICRO_STEPS
from conformance.signatures import SpecError, refuse_grad_bucket

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

#: The models of the parity cases; hard inputs run through the probes (``large_probe``: the hook gets 2 shards'
#: reduce-scatter output of more than 2^21 elements).
PARITY_MODELS = ("nested_wrapped",)
#: The long run's model (:data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared): one FSDP unit, the
#: cheapest per step, at 2 ranks: 2 replicas of 1 shard on 2 nodes (and on the 2x2 mesh at nightly depth).
LONG_RUN_MODELS = ("net_flat",)
LONG_RUN_WORLD_SIZE = 2
#: The models of the accumulation cases (a unit only the last micro-batch uses, as for the other APIs).
ACCUMULATION_MODELS = ("nested_wrapped", "late_branch")
#: Accumulation under ``set_requires_all_reduce(False)`` (config ``all_reduce_off``): FSDP2 calls the hook on
#: every micro-batch all the same, so the hook must reduce each one as native HSDP does when nothing is set.
ACCUMULATION_ALSO = (("all_reduce_off", "nested_wrapped"),)
#: The replica count that is not a power of two: a run with a world size of ``3 * 2`` also checks there.
ODD_REPLICA_WORLD_SIZE = 3 * 2

_validate_call = called_as(2, "an FSDP2 replica all-reduce hook is called as hook(state, tensor), state = "
                              "spec.state(replica_group), and reduces tensor in place")


def validate(spec: HookSpec) -> Tuple[str, ...]:
    """``hook(state, tensor)``, exact: a lossy replica reduction has no contract here yet.

    Raises :class:`SpecError` for a ``lossy=`` contract, naming the other APIs that take one.
    """
    if spec.lossy is not None:
        raise SpecError(
            f"HookSpec {spec.name!r}: api='fsdp2_replica' checks exact replica reductions only; a lossy "
            "all-reduce across replicas cannot declare a LossyContract here yet: check its reduce-scatter "
            "part as api='fsdp2' or a DDP hook as api='ddp', which take lossy=LossyContract(...)")
    refuse_grad_bucket(spec, "fsdp2_replica", "hook(state, tensor) with a gradient tensor")
    return _validate_call(spec)


def _world_sizes(settings: Settings) -> List[int]:
    """The HSDP world size, and 6 (3 replicas) where the run has it or is at nightly depth."""
    sizes = [hsdp_world_size(settings.world_sizes)]
    if (settings.nightly or ODD_REPLICA_WORLD_SIZE in settings.world_sizes) and ODD_REPLICA_WORLD_SIZE not in sizes:
        sizes.append(ODD_REPLICA_WORLD_SIZE)
    return sizes


def _parity_world_sizes(settings: Settings) -> List[int]:
    """:func:`_world_sizes`, and the topology cases' 8 ranks at nightly depth (2 nodes of 4; their 2 and 4 ranks
    are no replica mesh, or the HSDP world size)."""
    sizes = _world_sizes(settings)
    return sizes + [ws for ws in two_node_world_sizes(settings) if ws > 2 * REPLICA_SHARDS and ws not in sizes]


def _nodes(world_size: int) -> int:
    """The node layout of a replica case: each replica a node of its own, where the replicas are 3 (a count
    that is not a power of two), else two nodes (:data:`~conformance.apis.TWO_NODES`: 2 nodes of 1, of 2, of 4)."""
    replicas = replica_shape(world_size)[0]
    return replicas if replicas % 2 else TWO_NODES


def _skip(settings: Settings) -> Any:
    return hsdp_unavailable(settings.world_sizes) or missing_api((SETUP.setter,))


def _long_run_world_sizes(settings: Settings) -> List[int]:
    """:data:`LONG_RUN_WORLD_SIZE`; at nightly depth the HSDP world size's 2x2 mesh too."""
    return [LONG_RUN_WORLD_SIZE] + ([hsdp_world_size(settings.world_sizes)] if settings.nightly else [])


def _cases(models: Sequence[str], world_sizes: Callable[[Settings], Sequence[int]] = _world_sizes,
           also: Sequence[Tuple[str, str]] = ()) -> CasePlan:
    """Per spec, ``models`` in the ``replica`` config and the ``(config, model)`` pairs of ``also``, at each of
    ``world_sizes(settings)``."""
    pairs = tuple(("replica", model) for model in models) + tuple(also)

    def plan(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        why = _skip(settings) or simulated_layout_skip(settings)
        return [dataclasses.replace(test.case(spec.name, config, ws, model=model, nodes=_nodes(ws)), skip=why)
                for spec in specs for ws in world_sizes(settings) for config, model in pairs]

    return plan


_test = functools.partial(SuiteTest, "fsdp2_replica", "config")


def _catalogue_plan(entry: CheckEntry) -> CasePlan:
    """The cases of a check the catalogue plans: the entry's model in the ``replica`` config at the HSDP world
    size (and 6 ranks where the run has them), each replica a node (:func:`_cases`), for the entry's specs."""
    cases = _cases((entry.model,))
    return lambda test, specs, settings: cases(test, [spec for spec in specs if entry.for_spec(spec)], settings)

APIS = (
    HookApi(name="fsdp2_replica",
            installed_with=("FSDPModule.set_all_reduce_hook(hook) on a 1-D shard mesh: the hook is the reduction "
                            "across replicas"),
            variant_field="config", stateful=True, validate=validate,
            builtin_hooks="conformance.apis.fsdp2_replica.builtin_hooks:REPLICA_HOOKS",
            models="conformance.apis.fsdp2_replica.models:ReplicaModels",
            catalogue_plan=_catalogue_plan,
            plans={"test_fsdp2_replica_parity": _test("fsdp2_replica_parity", "parity",
                                                      _cases(PARITY_MODELS, _parity_world_sizes), kind="exact"),
                   "test_fsdp2_replica_long_run": _test("fsdp2_replica_long_run", "long_run",
                                                        _cases(LONG_RUN_MODELS, _long_run_world_sizes),
                                                        kind="exact", depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_replica_switches": _test("fsdp2_replica_switches", "long_run", switch_plan(
                       _cases(LONG_RUN_MODELS, _long_run_world_sizes)), kind="switches"),
                   "test_fsdp2_replica_hard_inputs": _test("fsdp2_replica_hard_inputs", "hard_inputs",
                                                           _cases(("gradient_probe", "large_probe")),
                                                           kind="hard_inputs"),
                   "test_fsdp2_replica_accumulation": _test(
                       "fsdp2_replica_accumulation", "parity", _cases(ACCUMULATION_MODELS, also=ACCUMULATION_ALSO),
                       kind="exact",
                       params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_replica_registration": _test(
                       "fsdp2_replica_registration", "registration", registration_plan(
                           SETUP.setter, "replica", REGISTRATION_RULES, _world_sizes,
                           lambda settings: hsdp_unavailable(settings.world_sizes)))},
            checks={"registration": "conformance.apis.fsdp2_replica.models:registration"}),
)
