"""The FSDP1 API (``FullyShardedDataParallel.register_comm_hook``): validation and its suite tests.

FSDP calls ``hook(state, grad)`` under ``NO_SHARD`` and ``hook(state, grad, output)``
under the sharded strategies; a spec is checked under every strategy its hook
serves (its *variant*, the case field ``strategy``). The rank side (models,
recorder, native mixed precision) is ``models.py``; the diagnosis's arithmetic
``arithmetic.py``; the registration rules ``registration.py``.

Suite tests (``conformance/suite/test_fsdp.py``), each a :class:`~conformance.apis.SuiteTest`:

* ``averaging``, ``parity``, ``long_run``, ``accumulation`` (parity with ``no_sync()`` on all
  micro-batches of a step but the last), ``subgroup_parity``, ``clip_grad_norm``,
  ``clip_grad_norm_low_precision``, ``hard_inputs``, ``rank_consistency``: the
  shared rank checks (:data:`conformance.ranks.checks.common.SHARED_CHECKS`) over
  :class:`~conformance.apis.fsdp.models.FsdpModels`;
* ``registration``: ``register_comm_hook``'s contract with the hook under test
  (``fsdp.registration``, this API's own);
* ``lossy_error``, ``lossy_loss``, ``lossy_determinism``: a spec with
  ``lossy=LossyContract(...)`` gets those instead of the exact checks (averaging,
  parity, subgroup parity, clip_grad_norm_, hard inputs), and keeps the
  structural ones: the registration rules and rank consistency under ``NO_SHARD``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from conformance.apis import (LONG_RUN_STEPS, TWO_NODES, CasePlan, HookApi, SuiteTest, first_cross_rank_world_size,
                              simulated_layout_skip, subgroup_world_size, two_node_world_sizes)
from conformance.apis.switches import switch_plan
from conformance.cases import CaseParams
from conformance.catalogue import CheckEntry
from conformance.models import ACCUMULATION_MICRO_STEPS
from conformance.ulps import dtype_name
from conformance.apis.fsdp.validation import validate

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

#: The long run's model (exact claims; :data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared): one
#: FSDP unit, the cheapest per step, once per calling convention a hook serves (``NO_SHARD``'s
#: ``hook(state, grad)``, and the sharded strategies' ``hook(state, grad, output)``, which FSDP calls alike under
#: FULL_SHARD and SHARD_GRAD_OP), at the main world size; at nightly depth under every strategy and world size.
LONG_RUN_MODEL = "net_flat"
#: Reference models for parity at the main world size (``models.MODELS`` keys).
#: ``mixture_of_experts`` is left out on purpose: ``register_comm_hook`` gives
#: every FSDP unit the same hook and state, so a hook whose state holds the whole
#: group also reduces the expert unit's gradients (which the native path keeps
#: local to its one-rank group), and FSDP forces that unit to NO_SHARD, so a
#: sharded-only hook is called with two arguments. No hook can conform there.
PARITY_MODELS = ("net_wrapped", "net_flat", "nested_wrapped", "always_wrap_nested", "transformer_shared",
                 "nonuniform_req_grad")
#: Reference models for parity at an extra world size (kept short: it is a second pool).
EXTRA_PARITY_MODELS = ("net_wrapped", "nested_wrapped")
#: Models of the clip_grad_norm_ cases (main world size): several FSDP units, and parameters without
#: gradients on some ranks' units (``nonuniform_req_grad``: frozen parameters), as in PyTorch's
#: test_fsdp_clip_grad_norm.py.
CLIP_MODELS = ("nested_wrapped", "nonuniform_req_grad")
#: The strategies and model of the low-precision-gradient clip cases (``test_low_precision_grads`` of
#: test_fsdp_clip_grad_norm.py: FULL_SHARD and NO_SHARD, NestedWrappedModule).
LOW_PRECISION_CLIP = (("FULL_SHARD", "NO_SHARD"), "nested_wrapped")
#: The model of the subgroup cases: several FSDP units, shards that need padding.
SUBGROUP_MODEL = "nested_wrapped"
#: Models of the gradient-accumulation cases (``no_sync()`` on all micro-batches but the last): several
#: FSDP units whose shards need padding, and a unit only the last micro-batch uses (PyTorch issue 196996).
#: The main world size only: what 3 ranks add (rounding orders) is parity's, and the default run's 60 s
#: are spent there.
ACCUMULATION_MODELS = {"main": ("nested_wrapped", "late_branch"), "extra": ()}
#: Models whose NO_SHARD gradients are compared across ranks (the first only at an extra world size).
CONSISTENCY_MODELS = ("net_wrapped", "transformer_shared")

#: The registration rules (``conformance/apis/fsdp/registration.py``), from PyTorch's
#: test_fsdp_comm_hooks.py; ``hybrid_strategy_raises`` runs once per hook, as variant ``HYBRID``.
REGISTRATION_RULES = (
    "unset_before_registration",
    "reaches_every_unit",
    "second_registration_raises",
    "non_root_raises",
    "preset_submodule_raises",
    "hybrid_strategy_raises",
)


#: Why a sharded strategy's case at world size 1 (a one-GPU machine's NCCL pool) is skipped.
ONE_RANK_RUNS_NO_SHARD = ("with one rank FSDP runs NO_SHARD whatever the sharding strategy (FullyShardedDataParallel "
                          "warns 'FSDP is switching to use `NO_SHARD` ... since the world size is 1') and calls the "
                          "hook as hook(state, grad), so this strategy cannot be checked here; its cases at 2 and 3 "
                          "ranks check it")


def _training(test: SuiteTest, specs: Sequence[Any], settings: Settings,
              models: Optional[Dict[str, Sequence[str]]] = None, *, strategies: Optional[Sequence[str]] = None,
              skip: Optional[str] = None) -> List[CaseParams]:
    """Every spec x strategy it serves x world size (x model, ``models[role]``), in that order.

    ``strategies`` restricts the strategies; ``skip`` is the reason a case at world size 1 cannot run (``None``: it
    can). A sharded strategy at world size 1 is skipped (:data:`ONE_RANK_RUNS_NO_SHARD`).
    """
    out = []
    for spec in specs:
        for strategy in spec.strategies or ():
            if strategies is not None and strategy not in strategies:
                continue
            for ws in settings.world_sizes:
                why = (skip or (ONE_RANK_RUNS_NO_SHARD if strategy != "NO_SHARD" else None)) if ws < 2 else None
                for model in (None,) if models is None else models[settings.role(ws)]:
                    out.append(test.case(spec.name, strategy, ws, model=model, skip=why))
    return out


def _by_convention(spec: HookSpec, settings: Settings) -> Tuple[str, ...]:
    """The strategies a spec's long runs, production-sized and topology cases take: at nightly depth every one it
    serves, else
    one per calling convention (``NO_SHARD``, and the first sharded one it serves: FSDP calls the hook alike
    under FULL_SHARD and SHARD_GRAD_OP)."""
    served = tuple(spec.strategies or ())
    if settings.nightly:
        return served
    sharded = [s for s in served if s != "NO_SHARD"]
    return tuple(s for s in served if s == "NO_SHARD") + tuple(sharded[:1])


def _long_runs(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """The long run of :data:`LONG_RUN_MODEL` per spec and :func:`_by_convention`, at every world size of the
    main role."""
    return [case for spec in specs for strategy in _by_convention(spec, settings)
            for case in _training(test, [spec], settings, {"main": (LONG_RUN_MODEL,), "extra": ()},
                                  strategies=(strategy,))]


def _parity(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """Parity of :data:`PARITY_MODELS` (main world size) and :data:`EXTRA_PARITY_MODELS`, then the topology cases
    (:func:`_topology`)."""
    return (_training(test, specs, settings, {"main": PARITY_MODELS, "extra": EXTRA_PARITY_MODELS})
            + _topology(specs, settings, test))


#: The probe of production size (a flat parameter of 6,620,005 elements): two steps of its gradients, ordinary
#: ones and the named hard values placed at the ends and power-of-two boundaries of the hook's buffer, by
#: convention (:func:`_by_convention`), at every world size.
LARGE_PROBE = "large_probe"


def _hard_inputs(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """Hard inputs through ``gradient_probe`` under every strategy at every world size, then through
    :data:`LARGE_PROBE` by convention (:func:`_by_convention`)."""
    return _training(test, specs, settings) + [
        case for spec in specs for strategy in _by_convention(spec, settings)
        for case in _training(test, [spec], settings, {"main": (LARGE_PROBE,), "extra": (LARGE_PROBE,)},
                              strategies=(strategy,))]


def _registration(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """Every rule per spec and strategy, at the main world size; the hybrid rule once per spec."""
    ws = settings.world_size
    out = []
    for spec in specs:
        for rule in REGISTRATION_RULES:
            if rule == "hybrid_strategy_raises":
                why = ("HYBRID_SHARD needs at least 2 ranks to shard over; with 1, FSDP falls back to NO_SHARD"
                       if ws < 2 else None)
                out.append(test.case(spec.name, "HYBRID", ws, rule=rule, skip=why))
                continue
            out.extend(test.case(spec.name, strategy, ws, rule=rule) for strategy in spec.strategies or ())
    return out


def _subgroup(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """Parity on data-parallel subgroups (``conformance.ranks.checks.groups``): every strategy a spec serves, on
    the smallest even pool of at least four ranks (the run's, else the extra pool FSDP2's HSDP starts), the
    groups across two simulated nodes (:data:`~conformance.apis.TWO_NODES`)."""
    ws = subgroup_world_size(settings.world_sizes)
    why = simulated_layout_skip(settings)
    return [test.case(spec.name, strategy, ws, model=SUBGROUP_MODEL, nodes=TWO_NODES, skip=why) for spec in specs
            for strategy in spec.strategies or ()]


def _topology(specs: Sequence[Any], settings: Settings, test: SuiteTest) -> List[CaseParams]:
    """The topology cases: :data:`SUBGROUP_MODEL` on 2 nodes at each of
    :func:`~conformance.apis.two_node_world_sizes`, by convention (:func:`_by_convention`)."""
    why = simulated_layout_skip(settings)
    return [test.case(spec.name, strategy, ws, model=SUBGROUP_MODEL, nodes=TWO_NODES, skip=why)
            for spec in specs for strategy in _by_convention(spec, settings) for ws in two_node_world_sizes(settings)]


def _low_precision_clip(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """:data:`LOW_PRECISION_CLIP` at every world size (a float16 sum of three rounds where one of two is
    exact); skipped for a hook that claims a reduce dtype
    other than float16, the one ``test_low_precision_grads`` pins."""
    out = []
    for case in _training(test, specs, settings, {"main": LOW_PRECISION_CLIP[1:], "extra": LOW_PRECISION_CLIP[1:]},
                          strategies=LOW_PRECISION_CLIP[0]):
        spec = next(spec for spec in specs if spec.name == case.hook)
        claim = spec.reduce_dtype
        if spec.param_dtype not in (None, torch.float16) and case.skip is None:
            case = dataclasses.replace(case, skip=(
                f"float16 gradients kept (keep_low_precision_grads) train in float16, as PyTorch's "
                f"test_low_precision_grads pins, not in the claimed parameter dtype {dtype_name(spec.param_dtype)}"))
        if claim not in (None, torch.float16) and case.skip is None:
            case = dataclasses.replace(case, skip=(
                f"float16 gradients kept (keep_low_precision_grads) are checked for hooks that claim no reduce "
                f"dtype or float16, as PyTorch's test_low_precision_grads pins; under NO_SHARD native FSDP "
                f"leaves a {dtype_name(claim)} reduction's gradient in {dtype_name(claim)}, which FSDP, not "
                f"the hook, decides"))
        out.append(case)
    return out


#: Lossy contracts, every strategy a hook serves: the relative error per step and parameter on several FSDP
#: units of uneven sizes whose shards need padding (``nested_wrapped``), and on units whose parameters are
#: partly frozen, so FSDP leaves some gradients None (``nonuniform_req_grad``); at an extra world size, the first.
LOSSY_ERROR_MODELS = {"main": ("nested_wrapped", "nonuniform_req_grad"), "extra": ("nested_wrapped",)}
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy (first world size only).
LOSSY_LOSS_MODELS = {"main": ("transformer_shared",), "extra": ()}
#: Two runs from the same seed (first world size only).
LOSSY_DETERMINISM_MODELS = {"main": ("net_flat",), "extra": ()}


def _exact(spec: HookSpec) -> bool:
    return spec.lossy is None


def _of(keep: Callable[[Any], bool], plan: CasePlan) -> CasePlan:
    """``plan`` over the specs ``keep`` selects: exact claims get the exact checks, lossy contracts theirs."""
    return lambda test, specs, settings: plan(test, [spec for spec in specs if keep(spec)], settings)


def _first_world_size(plan: CasePlan) -> CasePlan:
    """``plan`` at one world size only (a training-loss or determinism case: not about rounding): the run's
    first of at least 2 ranks (:func:`~conformance.apis.first_cross_rank_world_size`)."""
    def at_one(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        ws = first_cross_rank_world_size(settings.world_sizes)
        return [c for c in plan(test, specs, settings) if c.world_size == ws]

    return at_one


#: A suite test of this API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "fsdp", "strategy")


def catalogue_plan(entry: CheckEntry) -> CasePlan:
    """The cases of a check the catalogue plans: the entry's model by convention (:func:`_by_convention`), at the
    main world size (every world size with ``world_sizes="every"``)."""
    models = {"main": (entry.model,), "extra": (entry.model,) if entry.world_sizes == "every" else ()}

    def plan(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        return [case for spec in specs if entry.for_spec(spec) for strategy in _by_convention(spec, settings)
                for case in _training(test, [spec], settings, models, strategies=(strategy,))]

    return plan


API = HookApi(
    name="fsdp",
    installed_with="FullyShardedDataParallel.register_comm_hook(state, hook)",
    variant_field="strategy",
    stateful=True,
    validate=validate,
    builtin_hooks="conformance.apis.fsdp.builtin_hooks:FSDP_HOOKS",
    models="conformance.apis.fsdp.models:FsdpModels",
    catalogue_plan=catalogue_plan, test_prefix="test_", check_prefix="",
    checks={"registration": "conformance.apis.fsdp.registration:registration"},
    plans={
        "test_averaging": _test("averaging", "averaging", _of(_exact, _training), kind="exact"),
        "test_parity": _test("parity", "parity", _of(_exact, _parity), kind="exact"),
        "test_long_run": _test("long_run", "long_run", _of(_exact, _long_runs), kind="exact",
                               depth_params=LONG_RUN_STEPS),
        "test_switches": _test("switches", "long_run", switch_plan(_of(_exact, _long_runs)), kind="switches"),
        "test_rank_consistency": _test("rank_consistency", "rank_grads", functools.partial(
            _training, models={"main": CONSISTENCY_MODELS, "extra": CONSISTENCY_MODELS[:1]}, strategies=("NO_SHARD",),
            skip="rank consistency needs at least 2 ranks"), kind="across_ranks"),
        "test_accumulation": _test("accumulation", "parity", _of(_exact, functools.partial(
            _training, models=ACCUMULATION_MODELS)), kind="exact", params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
        "test_registration": _test("registration", "registration", _registration),
        "test_hard_inputs": _test("hard_inputs", "hard_inputs", _of(_exact, _hard_inputs), kind="hard_inputs"),
        "test_subgroup_parity": _test("subgroup_parity", "parity", _of(_exact, _subgroup), params={"subgroup": True}),
        "test_clip_grad_norm": _test("clip_grad_norm", "clip_grad_norm", _of(_exact, functools.partial(
            _training, models={"main": CLIP_MODELS, "extra": ()}))),
        "test_clip_grad_norm_low_precision": _test("clip_grad_norm_low_precision", "clip_grad_norm",
                                                   _of(_exact, _low_precision_clip),
                                                   params={"low_precision_grads": True}),
        "test_lossy_error": _test("lossy_error", "lossy_error", _of(lambda spec: not _exact(spec), functools.partial(
            _training, models=LOSSY_ERROR_MODELS, skip="the mean over one rank is its local gradient: nothing to bound")),
            kind="lossy_error"),
        "test_lossy_loss": _test("lossy_loss", "lossy_loss", _of(
            lambda spec: spec.lossy is not None and spec.lossy.loss_margin is not None,
            _first_world_size(functools.partial(_training, models=LOSSY_LOSS_MODELS))), kind="lossy_loss"),
        "test_lossy_determinism": _test("lossy_determinism", "lossy_determinism", _of(
            lambda spec: spec.lossy is not None and spec.lossy.deterministic,
            _first_world_size(functools.partial(_training, models=LOSSY_DETERMINISM_MODELS))),
            kind="lossy_determinism"),
    },
)
APIS = (API,)
