"""The FSDP2 APIs (``fully_shard`` custom comms and HSDP all-reduce hooks): validation and their suite tests.

``api="fsdp2"``: a ``ReduceScatter`` comm installed with
``FSDPModule.set_custom_reduce_scatter(comm)``; its cases vary the FSDP module
configuration (the case field ``config``, :data:`CONFIGS`), which decides the
``op`` FSDP2 hands the comm. ``api="fsdp2_all_reduce"``: a hook installed with
``FSDPModule.set_all_reduce_hook(hook)`` under native HSDP, or under ``replicate``
built on FSDP2 (:data:`ALL_REDUCE_CONFIGS`).
The rank side (the models of both) is ``models.py``, with ``build.py`` (meshes,
``fully_shard``), ``recorders.py`` (what FSDP2 hands a comm or a hook) and
``arithmetic.py`` (the diagnosis's).

Suite tests (``conformance/suite/test_fsdp2.py``), each a :class:`~conformance.apis.SuiteTest`
of one of the two APIs: ``fsdp2_parity``, ``fsdp2_long_run``, ``fsdp2_hard_inputs``,
``fsdp2_clip_grad_norm``, ``fsdp2_accumulation`` (parity over micro-batches that
skip synchronisation) and the lossy contracts (``fsdp2_lossy_*``, which a comm
with ``lossy=LossyContract(...)`` gets instead of the first three);
``fsdp2_all_reduce_hook``, ``fsdp2_all_reduce_long_run``, ``fsdp2_all_reduce_accumulation`` and
``fsdp2_all_reduce_hard_inputs``. Every one is a
shared rank check (:data:`conformance.ranks.checks.SHARED_CHECKS`) but the registration
rules, ``fsdp2_registration`` and ``fsdp2_all_reduce_registration``
(:data:`REGISTRATION_RULES`; each API's own rank check ``<api>.registration``, in
``registration.py``), which every spec gets, exact or lossy. An
``fsdp2_all_reduce`` hook cannot declare a contract (:func:`validate_all_reduce_hook`).

Only ``torch`` is imported at module level: what FSDP2 offers is looked up when
a case is planned (:func:`conformance.apis.fsdp2.build.missing_api`), so this
module imports on torch versions without FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from conformance.apis import (LONG_RUN_STEPS, TWO_NODES, CasePlan, HookApi, SuiteTest, called_as,
                              first_cross_rank_world_size, no_strategies, simulated_layout_skip, two_node_world_sizes)
from conformance.apis.fsdp2.build import HSDP_REPLICATE, missing_api, missing_replicate
from conformance.cases import CaseParams
from conformance.models import ACCUMULATION_MICRO_STEPS, MODELS
from conformance.signatures import SpecError, binds_signature, qualname, signature_text


#: Configurations of the FSDP modules a comm is checked under.
#: ``default``: nothing set; ``divide_factor``: ``set_gradient_divide_factor``;
#: ``force_sum``: ``set_force_sum_reduction_for_comms(True)``;
#: ``divide_factor_force_sum``: both; ``hsdp``: a 2-D (replicate, shard) mesh; ``subgroup``: a
#: 1-D mesh over this rank's data-parallel subgroup (``conformance.ranks.checks.groups``), not WORLD.
CONFIGS = ("default", "divide_factor", "force_sum", "divide_factor_force_sum", "divide_factor_some", "hsdp",
           "hsdp_divide_factor", "subgroup", "replicate")

#: FSDPModule methods each config needs (besides ``set_custom_reduce_scatter``).
CONFIG_APIS: Dict[str, Tuple[str, ...]] = {
    "default": (),
    "divide_factor": ("set_gradient_divide_factor",),
    "force_sum": ("set_force_sum_reduction_for_comms",),
    "divide_factor_force_sum": ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"),
    "divide_factor_some": ("set_gradient_divide_factor",),
    "hsdp": (),
    "hsdp_divide_factor": ("set_gradient_divide_factor",),
    "subgroup": (),
    "replicate": (),
}

#: Why gloo cannot run the native reference of a ``divide_factor`` config in float32/bfloat16.
GLOO_PREMUL_SUM = (
    "gloo has no ReduceOp.PREMUL_SUM (RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo): for a "
    "float32/bfloat16 reduce dtype, FSDP2's set_gradient_divide_factor(factor) with factor != the shard "
    "group size reduces with ReduceOp.PREMUL_SUM(1/factor), so the native reference cannot run on gloo; "
    "this case runs on NCCL"
)


def uses_premul_sum(config: str, reduce_dtype: Optional[torch.dtype], param_dtype: torch.dtype = torch.float32) -> bool:
    """Whether FSDP2 reduces with ``PREMUL_SUM`` under ``config`` (see ``_get_gradient_divide_factors``)."""
    dtype = reduce_dtype or param_dtype
    return config in ("divide_factor", "divide_factor_some", "hsdp_divide_factor") and \
        dtype in (torch.float32, torch.bfloat16)


#: ``(config, model)`` pairs per world-size role and claim. The full-precision claim runs
#: every reference model at the main world size; a reduced-precision claim (its comm sees
#: the same ops on bfloat16/float16 buffers) runs fewer. The divide-factor and forced-SUM
#: configs run on one model: they change the op FSDP2 passes, not the model.
FACTOR_CONFIGS = ("divide_factor", "force_sum", "divide_factor_force_sum", "divide_factor_some")
PLAN: Dict[Tuple[str, str], Tuple[Tuple[str, str], ...]] = {
    ("main", "full"): tuple(("default", m) for m in ("net_wrapped", "nested_wrapped", "always_wrap_nested",
                                                     "gradient_probe", "mixture_of_experts"))
    + tuple((c, "nested_wrapped") for c in FACTOR_CONFIGS) + (("replicate", "nested_wrapped"),),
    ("extra", "full"): (("default", "nested_wrapped"), ("default", "gradient_probe"),
                        ("divide_factor", "nested_wrapped"), ("divide_factor_force_sum", "nested_wrapped"),
                        ("force_sum", "gradient_probe")),
    ("main", "low"): (("default", "nested_wrapped"), ("divide_factor", "nested_wrapped"),
                      ("divide_factor_force_sum", "nested_wrapped"), ("divide_factor_some", "nested_wrapped")),
    ("extra", "low"): (("default", "nested_wrapped"),),
    ("hsdp", "full"): (("hsdp", "nested_wrapped"), ("hsdp_divide_factor", "nested_wrapped"),
                       ("subgroup", "nested_wrapped")),
    ("hsdp", "low"): (("hsdp", "nested_wrapped"), ("hsdp_divide_factor", "nested_wrapped"),
                      ("subgroup", "nested_wrapped")),
}
#: Hard inputs through the probe, per world-size role, in the default config: the op FSDP2
#: passes for the claim (AVG for float32/bfloat16; for float16, SUM with FSDP2's own pre- and
#: post-divide, where an undivided sum overflows first). Not under HSDP or the other configs:
#: the comm sees the same ops there, and the default run's 60 s budget is better spent at 2
#: and 3 ranks (an all-reduce hook's hard inputs run under HSDP, its only setting).
HARD_INPUT_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "main": (("default", "gradient_probe"), ("default", "large_probe")),
    "extra": (("default", "gradient_probe"), ("default", "large_probe")),
}
#: Lossy contracts: the relative error per step and parameter, per world-size role, in the configs whose
#: native reference gloo runs: ``default`` (FSDP2 passes AVG for float32/bfloat16, SUM with its own divides
#: for float16), ``force_sum`` (SUM, FSDP2 divides) and ``hsdp`` (the comm over the shard group, then
#: FSDP2's own replicate all-reduce). Not ``divide_factor``: PREMUL_SUM, which gloo cannot run.
LOSSY_ERROR_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "main": (("default", "nested_wrapped"), ("default", "always_wrap_nested"), ("force_sum", "nested_wrapped")),
    "extra": (("default", "nested_wrapped"),),
    "hsdp": (("hsdp", "nested_wrapped"),),
}
#: The long run (exact claims; :data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared), per world-size
#: role: one FSDP unit (the cheapest per step) in the default config at the main world size; at nightly depth
#: at every world size (every world size is "main" there). An all-reduce hook's runs under ``replicate`` (AVG),
#: whose pools are those of the comm's cases.
LONG_RUN_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("default", "net_flat"),)}
ALL_REDUCE_LONG_RUN_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("replicate", "net_flat"),)}
#: Gradient accumulation (exact claims), per world-size role: ``set_requires_gradient_sync(False)`` on all
#: micro-batches but the last (no comm call; FSDP2 accumulates the unsharded gradients in the reduce dtype,
#: PyTorch PR 125191), with a unit only the last micro-batch uses (PyTorch issue 196996); under HSDP
#: ``set_requires_all_reduce(False)`` (the comm runs on every micro-batch, the replica all-reduce on the
#: last).
ACCUMULATION_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "main": (("default", "nested_wrapped"), ("default", "late_branch")),
    "hsdp": (("hsdp", "nested_wrapped"),),
}
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy (first world size).
LOSSY_LOSS_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("default", "transformer_shared"),)}
#: Two runs from the same seed (first world size).
LOSSY_DETERMINISM_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("default", "nested_wrapped"),)}
#: Models an all-reduce hook runs under native HSDP.
ALL_REDUCE_MODELS = ("nested_wrapped",)
#: Where FSDP2 calls an all-reduce hook after its own all-reduce: native HSDP; ``replicate`` on FSDP2 (its
#: default AVG, and ``set_gradient_divide_factor(1.0)``, a SUM: torchtitan's default).
ALL_REDUCE_CONFIGS = ("hsdp", "replicate", "replicate_sum")
#: The ``replicate`` configs' models, at every world size of the run.
REPLICATE_MODELS = ("nested_wrapped",)
#: The smallest HSDP world size: a HSDP_REPLICATE x 2 (replicate x shard) mesh.
HSDP_WORLD_SIZE = 2 * HSDP_REPLICATE
#: The registration rules of both FSDP2 APIs (``conformance/apis/fsdp2/registration.py``), one case each per
#: spec at one world size: the setter's target unset before registration; the suite's registration (the
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


def validate(spec: Any) -> Tuple[str, ...]:
    """A ``ReduceScatter`` comm (``allocate`` and ``__call__``), or a zero-argument factory of one."""
    no_strategies(spec)
    # A class is a factory (called with no arguments), even though it has an allocate attribute.
    is_comm = not isinstance(spec.hook, type) and callable(getattr(spec.hook, "allocate", None))
    if not is_comm and not binds_signature(spec.hook, 0):
        raise SpecError(
            f"HookSpec {spec.name!r}: for api='fsdp2' the hook is a ReduceScatter comm (an object "
            "with allocate() and __call__(output, input, group, op, async_op)) or a factory "
            f"called with no arguments that returns one; got {qualname(spec.hook)}"
            f"{signature_text(spec.hook)}"
        )
    return ()


_validate_hook_call = called_as(1, "an FSDP2 all-reduce hook is called as hook(tensor)")


def validate_all_reduce_hook(spec: Any) -> Tuple[str, ...]:
    """An all-reduce hook is called as ``hook(tensor)``, and claims exactness.

    Raises :class:`SpecError` for a ``lossy=`` contract: under native HSDP, FSDP2 calls the hook after its
    own replicate all-reduce and before the post-divide (``foreach_reduce``), so the hook carries out no
    data-parallel reduction whose error a contract could bound; lossy communication belongs in the
    reduce-scatter comm (``api="fsdp2"``), which may declare one.
    """
    if spec.lossy is not None:
        raise SpecError(
            f"HookSpec {spec.name!r}: api='fsdp2_all_reduce' takes no lossy contract: FSDP2 calls an all-reduce "
            "hook under HSDP after its own native replicate all-reduce and before the post-divide, so the hook "
            "does no data-parallel reduction for a LossyContract to bound; put lossy communication in a "
            "reduce-scatter comm (api='fsdp2'), which may declare lossy=LossyContract(...)")
    return _validate_hook_call(spec)


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


def registration_plan(setter: str, variant: str, rules: Sequence[str], world_sizes: Any,
                      unavailable: Any = lambda settings: None) -> CasePlan:
    """A registration plan (:data:`REGISTRATION_RULES`): every spec x rule, at ``world_sizes(settings)`` (one
    world size: registration is not about rounding), in ``variant``; skipped with the reason where
    ``unavailable(settings)`` gives one, where this torch has no ``FSDPModule.<setter>``, and, for the
    several-parameter-groups rule, where it has no ``ShardPlacementResult``."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        why = unavailable(settings) or missing_api((setter,))
        return [test.case(spec.name, variant, ws, rule=rule, skip=why or (
                    missing_shard_placement() if rule == "multiple_param_groups_raise" else None))
                for spec in specs for ws in world_sizes(settings) for rule in rules]

    return cases


def skip_reason(case: CaseParams, spec: Any, settings: Any) -> Optional[str]:
    """Why ``case`` cannot run here, after its world size's availability (``None``: it runs)."""
    if case.nodes > 1 and simulated_layout_skip(settings):
        return simulated_layout_skip(settings)
    if case.variant in ("replicate", "replicate_sum"):
        why = missing_replicate()
        if why is not None:
            return why
        if case.world_size < 2:
            return "replicate over a single rank all-reduces nothing, so there is nothing to check"
    if case.variant in ("hsdp", "hsdp_divide_factor", "subgroup"):
        why = hsdp_unavailable(settings.world_sizes)
        if why is not None:
            return why
    if case.world_size < 2:
        return "FSDP2 calls no reduce-scatter over a single rank (it copies the gradient), so there is nothing to check"
    needed = ("set_all_reduce_hook",) if case.api == "fsdp2_all_reduce" else (
        ("set_custom_reduce_scatter",) + CONFIG_APIS[case.variant])
    why = missing_api(needed)
    if why is not None:
        return why
    if settings.placement(case.world_size)[0] == "gloo" and uses_premul_sum(case.variant, spec.reduce_dtype):
        return GLOO_PREMUL_SUM
    return None


def _with_skips(cases: List[CaseParams], specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    by_name = {spec.name: spec for spec in specs}
    return [dataclasses.replace(c, skip=skip_reason(c, by_name[c.hook], settings)) for c in cases if c.model in MODELS]


def _exact(spec: Any) -> bool:
    return spec.lossy is None


def _nodes(role: str) -> int:
    """The node layout of a role's cases: the HSDP mesh's replicas across two simulated nodes, each node one
    shard group (:data:`~conformance.apis.TWO_NODES`); one node otherwise."""
    return TWO_NODES if role == "hsdp" else 1


#: The model of the topology cases: the default config on 2 nodes at each of
#: :func:`~conformance.apis.two_node_world_sizes` (a 1-D mesh across both).
TOPOLOGY_MODEL = "nested_wrapped"


def parity_cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """The comm cases of a run: per spec that claims exactness, :data:`PLAN` at each world size by its
    role, then HSDP (on 2 nodes), then the topology cases (:data:`TOPOLOGY_MODEL`)."""
    out = []
    for spec in filter(_exact, specs):
        claim = "full" if spec.reduce_dtype is None else "low"
        roles = [(settings.role(ws), ws) for ws in settings.world_sizes]
        roles.append(("hsdp", hsdp_world_size(settings.world_sizes)))
        for role, ws in roles:
            out.extend(test.case(spec.name, config, ws, model=model, nodes=_nodes(role))
                       for config, model in PLAN[(role, claim)])
        out.extend(test.case(spec.name, "default", ws, model=TOPOLOGY_MODEL, nodes=TWO_NODES)
                   for ws in two_node_world_sizes(settings))
    return _with_skips(out, specs, settings)


def hard_input_cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """The comm's hard-input cases (exact claims): :data:`HARD_INPUT_PLAN` at each world size by its role."""
    out = []
    for spec in filter(_exact, specs):
        for role, ws in [(settings.role(ws), ws) for ws in settings.world_sizes]:
            out.extend(test.case(spec.name, config, ws, model=model) for config, model in HARD_INPUT_PLAN[role])
    return _with_skips(out, specs, settings)


def clip_cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """clip_grad_norm_ with the comm installed (exact claims): ``nested_wrapped``, default config, main world
    size."""
    ws = settings.world_sizes[0]
    return _with_skips([test.case(spec.name, "default", ws, model="nested_wrapped") for spec in filter(_exact, specs)],
                       specs, settings)


def role_plan(plan: Dict[str, Tuple[Tuple[str, str], ...]], keep: Any, *, first_only: bool = False) -> CasePlan:
    """A case plan by world-size role (the lossy contracts, accumulation): per kept spec, ``plan[role]`` at
    each world size by its role (only one with ``first_only``:
    :func:`~conformance.apis.first_cross_rank_world_size`), then ``plan["hsdp"]`` at the HSDP world size."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        out = []
        for spec in filter(keep, specs):
            sizes = (first_cross_rank_world_size(settings.world_sizes),) if first_only else settings.world_sizes
            roles = [(settings.role(ws), ws) for ws in sizes] + [("hsdp", hsdp_world_size(settings.world_sizes))]
            for role, ws in roles:
                out.extend(test.case(spec.name, config, ws, model=model, nodes=_nodes(role))
                           for config, model in plan.get(role, ()))
        return _with_skips(out, specs, settings)

    return cases


def all_reduce_cases(test: SuiteTest, specs: Sequence[Any], settings: Any, models: Sequence[str] = ALL_REDUCE_MODELS,
                     replicate_models: Sequence[str] = (), large: Sequence[str] = ()) -> List[CaseParams]:
    """An all-reduce hook's cases: each of ``models`` under HSDP, then each of ``replicate_models`` under the
    ``replicate`` configs at every world size of the run (and the topology cases), then each of ``large`` (the
    probe of production size: whole gradients of 25 MiB) under ``replicate`` at every world size."""
    ws = hsdp_world_size(settings.world_sizes)
    out = [test.case(spec.name, "hsdp", ws, model=model, nodes=TWO_NODES) for spec in specs for model in models]
    out += [test.case(spec.name, config, size, model=model) for spec in specs for size in settings.world_sizes
            for config in ("replicate", "replicate_sum") for model in replicate_models]
    if replicate_models:  # the parity cases: the topology cases too
        out += [test.case(spec.name, "replicate", size, model=TOPOLOGY_MODEL, nodes=TWO_NODES) for spec in specs
                for size in two_node_world_sizes(settings) if size != ws]
    out += [test.case(spec.name, "replicate", size, model=model) for spec in specs for size in settings.world_sizes
            for model in large]
    return _with_skips(out, specs, settings)


#: A suite test of each API: ``_comm_test(check, rank_check, plan, kind=..., params=...)``.
_comm_test = functools.partial(SuiteTest, "fsdp2", "config")
_all_reduce_test = functools.partial(SuiteTest, "fsdp2_all_reduce", "config")

APIS = (
    HookApi(name="fsdp2", installed_with="FSDPModule.set_custom_reduce_scatter(comm)", variant_field="config",
            stateful=False, validate=validate, builtin_hooks="conformance.apis.fsdp2.builtin_hooks:FSDP2_HOOKS",
            default_hook="conformance.apis.fsdp2.builtin_hooks:default_hook",
            standalone="conformance.apis.fsdp2.standalone",
            models="conformance.apis.fsdp2.models:CommModels",
            plans={"test_fsdp2_parity": _comm_test("fsdp2_parity", "parity", parity_cases, kind="exact"),
                   "test_fsdp2_long_run": _comm_test("fsdp2_long_run", "long_run", role_plan(LONG_RUN_PLAN, _exact),
                                                     kind="exact", depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_hard_inputs": _comm_test("fsdp2_hard_inputs", "hard_inputs", hard_input_cases,
                                                        kind="hard_inputs"),
                   "test_fsdp2_clip_grad_norm": _comm_test("fsdp2_clip_grad_norm", "clip_grad_norm", clip_cases),
                   "test_fsdp2_accumulation": _comm_test("fsdp2_accumulation", "parity", role_plan(
                       ACCUMULATION_PLAN, _exact), kind="exact", params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_lossy_error": _comm_test("fsdp2_lossy_error", "lossy_error", role_plan(
                       LOSSY_ERROR_PLAN, lambda spec: not _exact(spec)), kind="lossy_error"),
                   "test_fsdp2_lossy_loss": _comm_test("fsdp2_lossy_loss", "lossy_loss", role_plan(
                       LOSSY_LOSS_PLAN, lambda spec: spec.lossy is not None and spec.lossy.loss_margin is not None,
                       first_only=True), kind="lossy_loss"),
                   "test_fsdp2_lossy_determinism": _comm_test("fsdp2_lossy_determinism", "lossy_determinism", role_plan(
                       LOSSY_DETERMINISM_PLAN, lambda spec: spec.lossy is not None and spec.lossy.deterministic,
                       first_only=True), kind="lossy_determinism"),
                   "test_fsdp2_registration": _comm_test("fsdp2_registration", "registration", registration_plan(
                       "set_custom_reduce_scatter", "default", REGISTRATION_RULES,
                       lambda settings: (settings.world_size,)))},
            checks={"registration": "conformance.apis.fsdp2.registration:comm_registration"}),
    HookApi(name="fsdp2_all_reduce", installed_with="FSDPModule.set_all_reduce_hook(hook) (HSDP, replicate)",
            variant_field="config", stateful=False,
            validate=validate_all_reduce_hook, builtin_hooks=None,
            standalone="conformance.apis.fsdp2.standalone",
            models="conformance.apis.fsdp2.models:AllReduceHookModels",
            plans={"test_fsdp2_all_reduce_hook": _all_reduce_test("fsdp2_all_reduce_hook", "parity", functools.partial(
                all_reduce_cases, replicate_models=REPLICATE_MODELS)),
                   "test_fsdp2_all_reduce_long_run": _all_reduce_test(
                       "fsdp2_all_reduce_long_run", "long_run", role_plan(ALL_REDUCE_LONG_RUN_PLAN, _exact),
                       kind="exact", depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_all_reduce_accumulation": _all_reduce_test(
                       "fsdp2_all_reduce_accumulation", "parity", all_reduce_cases,
                       params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_all_reduce_hard_inputs": _all_reduce_test(
                       "fsdp2_all_reduce_hard_inputs", "hard_inputs",
                       functools.partial(all_reduce_cases, models=("gradient_probe",), large=("large_probe",)),
                       kind="hard_inputs"),
                   "test_fsdp2_all_reduce_registration": _all_reduce_test(
                       "fsdp2_all_reduce_registration", "registration", registration_plan(
                           "set_all_reduce_hook", "hsdp", REGISTRATION_RULES + (HSDP_STREAM_RULE,),
                           lambda settings: (hsdp_world_size(settings.world_sizes),),
                           lambda settings: hsdp_unavailable(settings.world_sizes)))},
            checks={"registration": "conformance.apis.fsdp2.registration:all_reduce_hook_registration"}),
)
