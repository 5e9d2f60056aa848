"""The reduce-scatter comm API (``api="fsdp2"``): validation and its suite tests.

A ``ReduceScatter`` comm installed with ``FSDPModule.set_custom_reduce_scatter(comm)``
on every FSDP module; its cases vary the FSDP module configuration (the case
field ``config``, the configs of its setup object
:data:`~conformance.apis.fsdp2.standalone.SETUP`), which decides the ``op``
FSDP2 hands the comm. The rank side is ``models.py``, with ``recorder.py``
(what FSDP2 hands the comm) and ``arithmetic.py`` (the diagnosis's); what the
FSDP2 APIs share is in ``conformance/apis/fsdp2_common/``.

Suite tests (``conformance/suite/test_fsdp2.py``), each a :class:`~conformance.apis.SuiteTest`:
``fsdp2_parity``, ``fsdp2_long_run``, ``fsdp2_hard_inputs``, ``fsdp2_clip_grad_norm``,
``fsdp2_accumulation`` (parity over micro-batches that skip synchronisation) and
the lossy contracts (``fsdp2_lossy_*``, which a comm with
``lossy=LossyContract(...)`` gets instead of the first three). Every one is a
shared rank check (:data:`conformance.ranks.checks.common.SHARED_CHECKS`) but the
registration rules, ``fsdp2_registration``
(:data:`~conformance.apis.fsdp2_common.plan.REGISTRATION_RULES`; the API's own
rank check ``fsdp2.registration``), which every spec gets, exact or lossy.

Only ``torch`` is imported at module level: what FSDP2 offers is looked up when
a case is planned (:func:`conformance.apis.fsdp2_common.build.missing_api`), so
this module imports on torch versions without FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from conformance.apis import (LONG_RUN_STEPS, TWO_NODES, CasePlan, HookApi, SuiteTest, no_strategies,
                              two_node_world_sizes)
from conformance.apis.switches import switch_plan
from conformance.apis.fsdp2.standalone import SETUP
from conformance.apis.fsdp2_common.plan import (REGISTRATION_RULES, TOPOLOGY_MODEL, RolePlan, catalogue_plan, exact,
                                                hsdp_world_size, registration_plan, role_nodes, role_plan, skip_reason,
                                                with_skips)
from conformance.cases import CaseParams
from conformance.models import ACCUMULATION_MICRO_STEPS
from conformance.signatures import (ALL_GATHER_CALL, REDUCE_SCATTER_CALL, SpecError, binds_signature, qualname,
                                    refuse_unfit_comm, signature_text)

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

#: Configurations of the FSDP modules a comm is checked under (:data:`~conformance.apis.fsdp2.standalone.SETUP`).
CONFIGS = tuple(SETUP.configs)


def uses_premul_sum(config: str, reduce_dtype: Optional[torch.dtype], param_dtype: torch.dtype = torch.float32) -> bool:
    """Whether FSDP2 reduces with ``PREMUL_SUM`` under ``config`` (see ``_get_gradient_divide_factors``)."""
    return SETUP.configs[config].premul_sum(reduce_dtype, param_dtype)


#: ``(config, model)`` pairs per world-size role, whatever the spec claims: a comm that claims a reduce dtype (its
#: comm sees bfloat16/float16 buffers, or float32 ones of bfloat16 parameters) gets every model and config a comm
#: without a claim gets, each skipped with its reason where the native reference for the claim cannot run here
#: (:func:`~conformance.apis.fsdp2_common.plan.skip_reason`). The divide-factor and forced-SUM configs run on one
#: model: they change the op FSDP2 passes, not the model.
FACTOR_CONFIGS = ("divide_factor", "force_sum", "divide_factor_force_sum", "divide_factor_some")
PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "main": tuple(("default", m) for m in ("net_wrapped", "nested_wrapped", "always_wrap_nested", "gradient_probe",
                                           "mixture_of_experts"))
    + tuple((c, "nested_wrapped") for c in FACTOR_CONFIGS) + (("replicate", "nested_wrapped"),
                                                               ("unused_params", "unused_param"),
                                                               ("sum_no_divide", "nested_wrapped")),
    "extra": (("default", "nested_wrapped"), ("default", "gradient_probe"), ("divide_factor", "nested_wrapped"),
              ("divide_factor_force_sum", "nested_wrapped"), ("force_sum", "gradient_probe"),
              ("sum_no_divide", "gradient_probe")),
    "hsdp": (("hsdp", "nested_wrapped"), ("hsdp_divide_factor", "nested_wrapped"), ("subgroup", "nested_wrapped")),
}
#: Hard inputs through the probe, per world-size role, in the default config: the op FSDP2
#: passes for the claim (AVG for float32/bfloat16; for float16, SUM with FSDP2's own pre- and
#: post-divide, where an undivided sum overflows first). Not under HSDP or the other configs:
#: the comm sees the same ops there, and the default run's 60 s budget is better spent at 2
#: and 3 ranks (an all-reduce hook's hard inputs run under HSDP, its only setting).
HARD_INPUT_PLAN: RolePlan = {
    "main": (("default", "gradient_probe"), ("default", "large_probe")),
    "extra": (("default", "gradient_probe"), ("default", "large_probe")),
}
#: Lossy contracts: the relative error per step and parameter, per world-size role, in the configs whose
#: native reference gloo runs: ``default`` (FSDP2 passes AVG for float32/bfloat16, SUM with its own divides
#: for float16), ``force_sum`` (SUM, FSDP2 divides) and ``hsdp`` (the comm over the shard group, then
#: FSDP2's own replicate all-reduce). Not ``divide_factor``: PREMUL_SUM, which gloo cannot run.
LOSSY_ERROR_PLAN: RolePlan = {
    "main": (("default", "nested_wrapped"), ("default", "always_wrap_nested"), ("force_sum", "nested_wrapped")),
    "extra": (("default", "nested_wrapped"),),
    "hsdp": (("hsdp", "nested_wrapped"),),
}
#: The long run (exact claims; :data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared), per world-size
#: role: one FSDP unit (the cheapest per step) in the default config at the main world size; at nightly depth
#: at every world size (every world size is "main" there).
LONG_RUN_PLAN: RolePlan = {"main": (("default", "net_flat"),)}
#: Gradient accumulation (exact claims), per world-size role: ``set_requires_gradient_sync(False)`` on all
#: micro-batches but the last (no comm call; FSDP2 accumulates the unsharded gradients in the reduce dtype,
#: PyTorch PR 125191), with a unit only the last micro-batch uses (PyTorch issue 196996); under HSDP
#: ``set_requires_all_reduce(False)`` (the comm runs on every micro-batch, the replica all-reduce on the
#: last).
ACCUMULATION_PLAN: RolePlan = {
    "main": (("default", "nested_wrapped"), ("default", "late_branch")),
    "hsdp": (("hsdp", "nested_wrapped"),),
}
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy (first world size).
LOSSY_LOSS_PLAN: RolePlan = {"main": (("default", "transformer_shared"),)}
#: Two runs from the same seed (first world size).
LOSSY_DETERMINISM_PLAN: RolePlan = {"main": (("default", "nested_wrapped"),)}


#: FSDP2's natives a comm may be meant for (``HookSpec.native_modes``), the default first. ``sum_no_divide``:
#: FSDP2 under ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` (its config of
#: that name), where it hands the comm ``SUM`` and divides nothing: a framework that scales gradients itself runs
#: it, and a comm that accepts only ``SUM`` (a bf16-wire reduce-scatter with float32 accumulation, say) is written
#: for it. ``accumulation``: FSDP2 training with ``set_requires_gradient_sync(False)`` on every micro-batch but the
#: last, the only way a comm built for gradient accumulation (one that defers its work to the synchronising
#: micro-batch) is equal to native: its other suite tests, which reduce every backward, are skipped with the reason.
SUM_MODE = "sum_no_divide"
ACCUMULATION_MODE = "accumulation"
NATIVE_MODES = ("default", SUM_MODE, ACCUMULATION_MODE)


def _mode_skip(spec: HookSpec, config: str, accumulation_only: bool = False) -> str:
    """Why ``spec``'s case in ``config`` is not checked: the spec is not meant for that config's native."""
    if accumulation_only:
        return (f"the spec is meant for FSDP2 under gradient accumulation only (native_modes={spec.native_modes!r}): "
                "its comm is checked where every micro-batch but the last runs set_requires_gradient_sync(False) "
                "(test_fsdp2_accumulation), not in a test that reduces every backward")
    if config == SUM_MODE:
        return (f"the spec is meant for FSDP2's default native only; HookSpec(native_modes=('default', '{SUM_MODE}')) "
                "checks it under set_gradient_divide_factor(1.0) and set_force_sum_reduction_for_comms(True) too")
    return (f"the spec is meant for FSDP2's {SUM_MODE} native only (native_modes={spec.native_modes!r}): its "
            f"cases run under set_gradient_divide_factor(1.0) and set_force_sum_reduction_for_comms(True), in "
            f"place of the default config; config {config!r} sets FSDP2 otherwise")


def with_native_modes(plan: CasePlan, *, accumulation: bool = False) -> CasePlan:
    """``plan`` (``accumulation``: the plan of ``test_fsdp2_accumulation``) as each spec's natives
    (:data:`NATIVE_MODES`) ask: a spec meant for the default keeps its cases (its ``sum_no_divide`` ones skipped
    with the reason unless it names that mode too); a spec meant for ``sum_no_divide`` and not the default has
    each ``default`` case run in that config instead (the same model, world size and layout; once where two fall
    together), and its other configs skipped with the reason; a spec meant for ``accumulation`` and not the
    default has every case of another plan skipped with the reason."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        by_name = {spec.name: spec for spec in specs}
        out: Dict[Any, CaseParams] = {}
        for case in plan(test, specs, settings):
            spec = by_name[case.hook]
            modes = spec.natives()
            if "default" not in modes and ACCUMULATION_MODE in modes and not accumulation:
                case = dataclasses.replace(case, skip=case.skip or _mode_skip(spec, case.variant, True))
            elif case.variant == SUM_MODE and SUM_MODE not in modes:
                case = dataclasses.replace(case, skip=case.skip or _mode_skip(spec, case.variant))
            elif case.variant != SUM_MODE and "default" not in modes and (SUM_MODE in modes or not accumulation):
                if case.variant == "default" and SUM_MODE in modes:
                    case = dataclasses.replace(case, variant=SUM_MODE)
                    case = dataclasses.replace(case, skip=skip_reason(SETUP, case, spec, settings))
                else:
                    case = dataclasses.replace(case, skip=case.skip or _mode_skip(spec, case.variant))
            out.setdefault(case, case)
        return list(out.values())

    return cases


def validate(spec: HookSpec) -> Tuple[str, ...]:
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
    refuse_unfit_comm(spec, "fsdp2", REDUCE_SCATTER_CALL, "fsdp2_all_gather", ALL_GATHER_CALL,
                      "an AllGather comm: FSDP2 calls it without op")
    return ()


def parity_cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """The comm cases of a run: per spec that claims exactness (whatever its reduce or parameter dtype),
    :data:`PLAN` at each world size by its role, then HSDP (on 2 nodes), then the topology cases
    (:data:`TOPOLOGY_MODEL`)."""
    out = []
    for spec in filter(exact, specs):
        roles = [(settings.role(ws), ws) for ws in settings.world_sizes]
        roles.append(("hsdp", hsdp_world_size(settings.world_sizes)))
        for role, ws in roles:
            out.extend(test.case(spec.name, config, ws, model=model, nodes=role_nodes(role))
                       for config, model in PLAN[role])
        out.extend(test.case(spec.name, "default", ws, model=TOPOLOGY_MODEL, nodes=TWO_NODES)
                   for ws in two_node_world_sizes(settings))
    return with_skips(SETUP, out, specs, settings)


def hard_input_cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """The comm's hard-input cases (exact claims): :data:`HARD_INPUT_PLAN` at each world size by its role."""
    out = []
    for spec in filter(exact, specs):
        for role, ws in [(settings.role(ws), ws) for ws in settings.world_sizes]:
            out.extend(test.case(spec.name, config, ws, model=model) for config, model in HARD_INPUT_PLAN[role])
    return with_skips(SETUP, out, specs, settings)


def clip_cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
    """clip_grad_norm_ with the comm installed (exact claims): ``nested_wrapped``, default config, main world
    size."""
    ws = settings.world_sizes[0]
    return with_skips(SETUP, [test.case(spec.name, "default", ws, model="nested_wrapped")
                              for spec in filter(exact, specs)], specs, settings)


#: A suite test of the API: ``_comm_test(check, rank_check, plan, kind=..., params=...)``.
_comm_test = functools.partial(SuiteTest, "fsdp2", "config")

APIS = (
    HookApi(name="fsdp2", installed_with="FSDPModule.set_custom_reduce_scatter(comm)", variant_field="config",
            stateful=False, validate=validate, builtin_hooks="conformance.apis.fsdp2.builtin_hooks:FSDP2_HOOKS",
            native_modes=NATIVE_MODES,
            catalogue_plan=catalogue_plan(SETUP, "default", wrap=with_native_modes),
            models="conformance.apis.fsdp2.models:CommModels",
            plans={"test_fsdp2_parity": _comm_test("fsdp2_parity", "parity", with_native_modes(parity_cases),
                                                   kind="exact"),
                   "test_fsdp2_long_run": _comm_test("fsdp2_long_run", "long_run", with_native_modes(role_plan(
                       SETUP, LONG_RUN_PLAN, exact)), kind="exact", depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_switches": _comm_test("fsdp2_switches", "long_run", with_native_modes(
                       switch_plan(role_plan(SETUP, LONG_RUN_PLAN, exact))), kind="switches"),
                   "test_fsdp2_hard_inputs": _comm_test("fsdp2_hard_inputs", "hard_inputs",
                                                        with_native_modes(hard_input_cases), kind="hard_inputs"),
                   "test_fsdp2_clip_grad_norm": _comm_test("fsdp2_clip_grad_norm", "clip_grad_norm",
                                                          with_native_modes(clip_cases)),
                   "test_fsdp2_accumulation": _comm_test("fsdp2_accumulation", "parity", with_native_modes(role_plan(
                       SETUP, ACCUMULATION_PLAN, exact), accumulation=True), kind="exact",
                       params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_lossy_error": _comm_test("fsdp2_lossy_error", "lossy_error", role_plan(
                       SETUP, LOSSY_ERROR_PLAN, lambda spec: not exact(spec)), kind="lossy_error"),
                   "test_fsdp2_lossy_loss": _comm_test("fsdp2_lossy_loss", "lossy_loss", role_plan(
                       SETUP, LOSSY_LOSS_PLAN,
                       lambda spec: spec.lossy is not None and spec.lossy.loss_margin is not None,
                       first_only=True), kind="lossy_loss"),
                   "test_fsdp2_lossy_determinism": _comm_test(
                       "fsdp2_lossy_determinism", "lossy_determinism", role_plan(
                           SETUP, LOSSY_DETERMINISM_PLAN,
                           lambda spec: spec.lossy is not None and spec.lossy.deterministic, first_only=True),
                       kind="lossy_determinism"),
                   "test_fsdp2_registration": _comm_test("fsdp2_registration", "registration", registration_plan(
                       SETUP.setter, "default", REGISTRATION_RULES,
                       lambda settings: (settings.world_size,)))},
            checks={"registration": "conformance.apis.fsdp2.models:registration"}),
)
