"""The all-reduce hook API (``api="fsdp2_all_reduce"``): validation and its suite tests.

A hook installed with ``FSDPModule.set_all_reduce_hook(hook)`` where FSDP2
calls it after its own all-reduce: under native HSDP, or under ``replicate``
built on FSDP2 (the configs of its setup object,
:data:`~conformance.apis.fsdp2_all_reduce.standalone.SETUP`). The rank side is
``models.py`` (with ``arithmetic.py``, the diagnosis's); what the FSDP2 APIs
share is in ``conformance/apis/fsdp2_common/``.

Suite tests (``conformance/suite/test_fsdp2.py``): ``fsdp2_all_reduce_hook``,
``fsdp2_all_reduce_long_run``, ``fsdp2_all_reduce_accumulation`` and
``fsdp2_all_reduce_hard_inputs``, each a shared rank check, and
``fsdp2_all_reduce_registration``, the registration rules
(:data:`~conformance.apis.fsdp2_common.plan.REGISTRATION_RULES` and
:data:`~conformance.apis.fsdp2_common.plan.HSDP_STREAM_RULE`; the API's own rank
check ``fsdp2_all_reduce.registration``). An all-reduce hook cannot declare a
contract (:func:`validate`).

Only ``torch`` is imported at module level, as for the other FSDP2 APIs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, List, Sequence, Tuple

from conformance.apis import LONG_RUN_STEPS, TWO_NODES, HookApi, SuiteTest, called_as, two_node_world_sizes
from conformance.apis.switches import switch_plan
from conformance.apis.fsdp2_all_reduce.standalone import SETUP
from conformance.apis.fsdp2_common.plan import (HSDP_STREAM_RULE, REGISTRATION_RULES, TOPOLOGY_MODEL, RolePlan,
                                               catalogue_plan,
                                                exact, hsdp_unavailable, hsdp_world_size, registration_plan,
                                                role_plan, with_skips)
from conformance.cases import CaseParams
from conformance.models import ACCUMULATION_MICRO_STEPS
from conformance.signatures import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

#: Where FSDP2 calls an all-reduce hook after its own all-reduce: native HSDP; ``replicate`` on FSDP2 (its
#: default AVG, and ``set_gradient_divide_factor(1.0)``, a SUM: torchtitan's default).
ALL_REDUCE_CONFIGS = tuple(SETUP.configs)
#: Models an all-reduce hook runs under native HSDP.
ALL_REDUCE_MODELS = ("nested_wrapped",)
#: The ``replicate`` configs' models, at every world size of the run.
REPLICATE_MODELS = ("nested_wrapped",)
#: The long run (exact claims; :data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared) under
#: ``replicate`` (AVG), one FSDP unit, at the main world size (at nightly depth at every world size).
ALL_REDUCE_LONG_RUN_PLAN: RolePlan = {"main": (("replicate", "net_flat"),)}

_validate_hook_call = called_as(1, "an FSDP2 all-reduce hook is called as hook(tensor)")


def validate(spec: HookSpec) -> Tuple[str, ...]:
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


def all_reduce_cases(test: SuiteTest, specs: Sequence[Any], settings: Settings,
                     models: Sequence[str] = ALL_REDUCE_MODELS, replicate_models: Sequence[str] = (),
                     large: Sequence[str] = ()) -> List[CaseParams]:
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
    return with_skips(SETUP, out, specs, settings)


#: A suite test of the API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "fsdp2_all_reduce", "config")

APIS = (
    HookApi(name="fsdp2_all_reduce", installed_with="FSDPModule.set_all_reduce_hook(hook) (HSDP, replicate)",
            variant_field="config", stateful=False, validate=validate, builtin_hooks=None,
            models="conformance.apis.fsdp2_all_reduce.models:AllReduceHookModels",
            catalogue_plan=catalogue_plan(SETUP, "replicate", hsdp_config="hsdp"),
            plans={"test_fsdp2_all_reduce_hook": _test("fsdp2_all_reduce_hook", "parity", functools.partial(
                all_reduce_cases, replicate_models=REPLICATE_MODELS)),
                   "test_fsdp2_all_reduce_long_run": _test(
                       "fsdp2_all_reduce_long_run", "long_run", role_plan(SETUP, ALL_REDUCE_LONG_RUN_PLAN, exact),
                       kind="exact", depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_all_reduce_switches": _test(
                       "fsdp2_all_reduce_switches", "long_run", switch_plan(role_plan(
                           SETUP, ALL_REDUCE_LONG_RUN_PLAN, exact)), kind="switches"),
                   "test_fsdp2_all_reduce_accumulation": _test(
                       "fsdp2_all_reduce_accumulation", "parity", all_reduce_cases,
                       params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_all_reduce_hard_inputs": _test(
                       "fsdp2_all_reduce_hard_inputs", "hard_inputs",
                       functools.partial(all_reduce_cases, models=("gradient_probe",), large=("large_probe",)),
                       kind="hard_inputs"),
                   "test_fsdp2_all_reduce_registration": _test(
                       "fsdp2_all_reduce_registration", "registration", registration_plan(
                           SETUP.setter, "hsdp", REGISTRATION_RULES + (HSDP_STREAM_RULE,),
                           lambda settings: (hsdp_world_size(settings.world_sizes),),
                           lambda settings: hsdp_unavailable(settings.world_sizes)))},
            checks={"registration": "conformance.apis.fsdp2_all_reduce.models:registration"}),
)
