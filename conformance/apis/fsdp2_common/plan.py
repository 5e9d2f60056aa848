"""What the FSDP2 APIs' case plans share: the HSDP pool, the registration rules' plan, and each case's skip reason.

Every FSDP2 API's plan (``conformance/apis/<api>/plan.py``) makes its cases with
these, passing its setup object (:class:`~conformance.apis.fsdp2_common.setup.Fsdp2Setup`):
a case's config says which mesh it needs, which ``FSDPModule`` methods this
torch must have (the API's setter and the config's), and whether gloo can run
its native reference (:func:`skip_reason`). Only ``torch`` is imported at
module level: what FSDP2 offers is looked up when a case is planned
(:func:`conformance.apis.fsdp2_common.build.missing_api`), so the plans import
on torch versions without FSDP2.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from conformance.apis import (TWO_NODES, CasePlan, CataloguePlan, SuiteTest, first_cross_rank_world_size,
                              simulated_layout_skip)
from conformance.catalogue import CheckEntry
from conformance.apis.fsdp2_common.setup import HSDP_REPLICATE, Fsdp2Setup
from conformance.cases import CaseParams
from conformance.models import MODELS

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec


def missing_api(methods: Sequence[str] = ()) -> Optional[str]:
    """:func:`conformance.apis.fsdp2_common.build.missing_api`, imported when a case is planned: the build imports
    FSDP2, which a run that plans no FSDP2 case never loads in the controller."""
    from conformance.apis.fsdp2_common import build

    return build.missing_api(methods)


def missing_replicate() -> Optional[str]:
    """:func:`conformance.apis.fsdp2_common.build.missing_replicate`, imported when a case is planned."""
    from conformance.apis.fsdp2_common import build

    return build.missing_replicate()

#: Why gloo cannot run the native reference of a ``divide_factor`` config in float32/bfloat16.
GLOO_PREMUL_SUM = (
    "gloo has no ReduceOp.PREMUL_SUM (RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo): for a "
    "float32/bfloat16 reduce dtype, FSDP2's set_gradient_divide_factor(factor) with factor != the shard "
    "group size reduces with ReduceOp.PREMUL_SUM(1/factor), so the native reference cannot run on gloo; "
    "this case runs on NCCL"
)
#: The smallest HSDP world size: a HSDP_REPLICATE x 2 (replicate x shard) mesh.
HSDP_WORLD_SIZE = 2 * HSDP_REPLICATE
#: The registration rules of every FSDP2 API (``conformance/apis/fsdp2_common/registration.py``), one case each
#: per spec at one world size: the setter's target unset before registration; the suite's registration (the
#: setter on every FSDP module) reaching every parameter group, where the root's alone does not; PyTorch's
#: ``ValueError`` on an FSDP module with several parameter groups (``shard_placement_fn``), and the
#: suite's clear refusal there.
REGISTRATION_RULES = ("unset_before_registration", "reaches_every_param_group", "multiple_param_groups_raise")
#: ``set_all_reduce_hook(hook, stream=...)`` under native HSDP raises: an ``fsdp2_all_reduce`` rule only.
HSDP_STREAM_RULE = "stream_under_hsdp_raises"
#: Whether a run none of whose world sizes fits HSDP (the default CPU run: 2 and 3) starts an
#: extra HSDP_WORLD_SIZE-rank pool for the HSDP cases (gloo on CPU runs HSDP). Measured on the
#: project's 2-core machine: about +6 s (under load up to +13 s) for the pool's start-up and
#: first FSDP2 use plus its cases. ``False`` skips HSDP in such runs, saying how to get it
#: (``--extra-world-size 4``). Runs on 4+ GPUs use their main pool either way.
START_HSDP_POOL = True
#: The model of the topology cases: the default config on 2 nodes at each of
#: :func:`~conformance.apis.two_node_world_sizes` (a 1-D mesh across both).
TOPOLOGY_MODEL = "nested_wrapped"
#: ``(config, model)`` pairs per world-size role (``"main"``, ``"extra"``, ``"hsdp"``).
RolePlan = Dict[str, Tuple[Tuple[str, str], ...]]


def hsdp_world_size(sizes: Sequence[int]) -> int:
    """The HSDP cases' world size: the smallest of the run's that fits a 2-D mesh, else HSDP_WORLD_SIZE."""
    fits = [ws for ws in sizes if ws >= HSDP_WORLD_SIZE and ws % HSDP_REPLICATE == 0]
    return min(fits) if fits else HSDP_WORLD_SIZE


def hsdp_unavailable(sizes: Sequence[int]) -> Optional[str]:
    """Why this run leaves HSDP out (``None``: it runs), see :data:`START_HSDP_POOL`."""
    if START_HSDP_POOL or hsdp_world_size(sizes) in sizes:
        return None
    return (f"HSDP needs a 2-D (replicate x shard) mesh of at least {HSDP_WORLD_SIZE} ranks and this run's world "
            f"sizes are {' and '.join(map(str, sizes))}; gloo on CPU does run HSDP, but the default run leaves "
            f"the extra {HSDP_WORLD_SIZE}-rank pool out to stay fast: add --extra-world-size {HSDP_WORLD_SIZE} "
            "to run these cases")


def missing_shard_placement() -> Optional[str]:
    """Why this torch cannot give one FSDP module several parameter groups (the ``multiple_param_groups_raise``
    rule), or ``None``."""
    try:  # an optional import: the answer to whether this torch has per-parameter meshes
        from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,  # noqa: F401 - probed
                                                                       ShardPlacementResult)
    except ImportError:
        return (f"torch {torch.__version__} has no ShardPlacementResult (torch.distributed.fsdp._fully_shard."
                "_fsdp_common): its fully_shard(shard_placement_fn=...) picks a Shard dimension on the module's own "
                "mesh only, so every FSDP module has one parameter group, and PyTorch's refusal of a comm or hook "
                "for several cannot arise")
    return None


def registration_plan(setter: str, variant: str, rules: Sequence[str], world_sizes: Callable[[Settings], Sequence[int]],
                      unavailable: Callable[[Settings], Optional[str]] = lambda settings: None) -> CasePlan:
    """A registration plan (:data:`REGISTRATION_RULES`): every spec x rule, at ``world_sizes(settings)`` (one
    world size: registration is not about rounding), in ``variant``; skipped with the reason where
    ``unavailable(settings)`` gives one, where this torch has no ``FSDPModule.<setter>``, and, for the
    several-parameter-groups rule, where it has no ``ShardPlacementResult``."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        why = unavailable(settings) or missing_api((setter,))
        return [test.case(spec.name, variant, ws, rule=rule, skip=why or (
                    missing_shard_placement() if rule == "multiple_param_groups_raise" else None))
                for spec in specs for ws in world_sizes(settings) for rule in rules]

    return cases


def skip_reason(setup: Fsdp2Setup, case: CaseParams, spec: HookSpec, settings: Settings) -> Optional[str]:
    """Why ``case`` (of the API ``setup`` describes) cannot run here, after its world size's availability
    (``None``: it runs): a simulated layout under ``--listen``, a torch without ``replicate`` on FSDP2, a mesh
    that needs the HSDP pool this run leaves out, a single rank, a torch without the API's setter or the
    config's methods, and a ``PREMUL_SUM`` native reference on gloo (:data:`GLOO_PREMUL_SUM`)."""
    layout = setup.configs[case.variant]
    if case.nodes > 1 and simulated_layout_skip(settings):
        return simulated_layout_skip(settings)
    if layout.mesh == "replicate":
        why = missing_replicate()
        if why is not None:
            return why
        if case.world_size < 2:
            return "replicate over a single rank all-reduces nothing, so there is nothing to check"
    if layout.mesh in ("hsdp", "subgroup"):
        why = hsdp_unavailable(settings.world_sizes)
        if why is not None:
            return why
    if case.world_size < 2:
        return "FSDP2 calls no reduce-scatter over a single rank (it copies the gradient), so there is nothing to check"
    why = missing_api((setup.setter,) + layout.methods)
    if why is not None:
        return why
    premul = layout.premul_sum(spec.reduce_dtype, spec.param_dtype or torch.float32)
    if settings.placement(case.world_size)[0] == "gloo" and premul:
        return GLOO_PREMUL_SUM
    return None


def with_skips(setup: Fsdp2Setup, cases: List[CaseParams], specs: Sequence[Any],
               settings: Settings) -> List[CaseParams]:
    """``cases`` of the known models, each with its :func:`skip_reason`."""
    by_name = {spec.name: spec for spec in specs}
    return [dataclasses.replace(c, skip=skip_reason(setup, c, by_name[c.hook], settings))
            for c in cases if c.model in MODELS]


def exact(spec: HookSpec) -> bool:
    """Whether ``spec`` claims exactness (no lossy contract)."""
    return spec.lossy is None


def role_nodes(role: str) -> int:
    """The node layout of a role's cases: the HSDP mesh's replicas across two simulated nodes, each node one
    shard group (:data:`~conformance.apis.TWO_NODES`); one node otherwise."""
    return TWO_NODES if role == "hsdp" else 1


def role_plan(setup: Fsdp2Setup, plan: RolePlan, keep: Callable[[Any], bool], *, first_only: bool = False) -> CasePlan:
    """A case plan by world-size role (the lossy contracts, accumulation, the long runs): per kept spec,
    ``plan[role]`` at each world size by its role (only one with ``first_only``:
    :func:`~conformance.apis.first_cross_rank_world_size`), then ``plan["hsdp"]`` at the HSDP world size."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        out = []
        for spec in filter(keep, specs):
            sizes = (first_cross_rank_world_size(settings.world_sizes),) if first_only else settings.world_sizes
            roles = [(settings.role(ws), ws) for ws in sizes] + [("hsdp", hsdp_world_size(settings.world_sizes))]
            for role, ws in roles:
                out.extend(test.case(spec.name, config, ws, model=model, nodes=role_nodes(role))
                           for config, model in plan.get(role, ()))
        return with_skips(setup, out, specs, settings)

    return cases


def catalogue_plan(setup: Fsdp2Setup, config: str, hsdp_config: Optional[str] = None,
                   wrap: Callable[[CasePlan], CasePlan] = lambda plan: plan) -> CataloguePlan:
    """An FSDP2 API's plan of a check the catalogue plans (:data:`~conformance.apis.CataloguePlan`): the entry's
    model in ``config`` at the main world size (every world size with ``world_sizes="every"``), and in
    ``hsdp_config`` at the HSDP world size where given (:func:`role_plan`); ``wrap``: the API's own cases
    around it (its native modes)."""
    def plan_of(entry: CheckEntry) -> CasePlan:
        roles: RolePlan = {"main": ((config, entry.model),)}
        if entry.world_sizes == "every":
            roles["extra"] = ((config, entry.model),)
        if hsdp_config is not None:
            roles["hsdp"] = ((hsdp_config, entry.model),)
        return wrap(role_plan(setup, roles, entry.for_spec))

    return plan_of
