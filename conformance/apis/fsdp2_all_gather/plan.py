"""The all-gather comm API (``api="fsdp2_all_gather"``): validation and its suite tests.

An ``AllGather`` comm installed with ``FSDPModule.set_custom_all_gather(comm)``
on every FSDP module (torch 2.9 and later); its cases vary the FSDP module
configuration (the case field ``config``, the configs of its setup object
:data:`~conformance.apis.fsdp2_all_gather.standalone.SETUP`): the mesh FSDP2
gathers over and whether it re-gathers in the backward. The rank side is
``models.py``, with ``recorder.py`` (what FSDP2 hands the comm, and each
gather checked bit for bit) and ``arithmetic.py`` (the causes of a wrong
gather); what the FSDP2 APIs share is in ``conformance/apis/fsdp2_common/``.

Suite tests (``conformance/suite/test_fsdp2_all_gather.py``):
``fsdp2_all_gather_parity`` (the shared lockstep check: losses, local gradient
shards and parameter shards bitwise equal to native FSDP2 after every step),
``fsdp2_all_gather_long_run`` (the shared long run),
``fsdp2_all_gather_hard_params`` (the API's own rank check
:func:`~conformance.apis.fsdp2_all_gather.models.hard_params`: hard parameter
shards gathered bit for bit) and ``fsdp2_all_gather_registration`` (the
registration rules, :data:`~conformance.apis.fsdp2_common.plan.REGISTRATION_RULES`).
A comm claims exactness: an all-gather only moves data (:func:`validate`).

Only ``torch`` is imported at module level, as for the other FSDP2 APIs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, List, Sequence, Tuple

from conformance.apis import LONG_RUN_STEPS, HookApi, SuiteTest, no_strategies
from conformance.apis.switches import switch_plan
from conformance.apis.fsdp2_all_gather.standalone import SETUP
from conformance.apis.fsdp2_common.plan import (REGISTRATION_RULES, RolePlan, catalogue_plan, exact, hsdp_world_size,
                                                registration_plan, role_nodes, role_plan, with_skips)
from conformance.cases import CaseParams
from conformance.models import ACCUMULATION_MICRO_STEPS
from conformance.signatures import (ALL_GATHER_CALL, REDUCE_SCATTER_CALL, SpecError, binds_signature, qualname,
                                    refuse_unfit_comm, signature_text)

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

#: Configurations of the FSDP modules a comm is checked under.
CONFIGS = tuple(SETUP.configs)
#: ``(config, model)`` pairs per world-size role: ``nested_wrapped`` (3 FSDP units, nested) with FSDP2's own
#: resharding (the root kept gathered), with none, and with the root's too (``set_reshard_after_forward(True)``)
#: at the main world size; HSDP's shard group and the subgroup mesh on the 4-rank pool.
#: The default run's 60 s budget keeps it to these (``always_wrap_nested`` at the other world sizes). The
#: production-sized probe runs in :data:`HARD_PARAMS_PLAN`, not here: a probe's gradients are its inputs
#: whatever its gathered weights, so its gradient parity would say nothing of the gather.
PLAN: RolePlan = {
    "main": (("default", "nested_wrapped"), ("no_reshard", "nested_wrapped"), ("reshard_root", "nested_wrapped")),
    "extra": (("default", "always_wrap_nested"),),
    "hsdp": (("hsdp", "nested_wrapped"), ("subgroup", "nested_wrapped")),
}
#: The long run (:data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared; each gather checked in the
#: replay of a difference only): one FSDP unit, the cheapest per step, at the main world size.
LONG_RUN_PLAN: RolePlan = {"main": (("default", "net_flat"),)}
#: Hard parameter shards, per world-size role: at the main world size and on the subgroup mesh, and the
#: production-sized probe (``large_probe``) at the main world size and at 3: its ``wide`` unit's
#: gather output has 6,620,006 elements at 2 ranks, 6,620,007 at 3 (more than 2^22; the parameter's 6,620,005
#: a multiple of no world size and of no power of two), every element a distinct value or a hard one, so a
#: chunk loop that drops the tail, a shard at a wrong offset or kept padding shows at production size.
HARD_PARAMS_PLAN: RolePlan = {"main": (("default", "nested_wrapped"), ("default", "large_probe")),
                              "extra": (("default", "large_probe"),), "hsdp": (("subgroup", "nested_wrapped"),)}
#: Gradient accumulation (the shared parity check over :data:`~conformance.models.ACCUMULATION_MICRO_STEPS`
#: micro-batches, all but the last under ``set_requires_gradient_sync(False)``; FSDP2 still gathers in each
#: one), on ``late_branch``, whose last unit only the last micro-batch uses (its gather runs once a step, the
#: others' once per micro-batch), at the main world size.
ACCUMULATION_PLAN: RolePlan = {"main": (("default", "late_branch"),)}
#: ``clip_grad_norm_`` with the comm installed (the shared check), at the first world size of at least 2 ranks
#: only, at every depth, as the reduce-scatter API's clip cases: at 3 ranks PyTorch's own FSDP2 hangs there (the
#: nightly run of 2026-11-27, torch 2.13 CPU: every rank of the reference model, no comm installed, waited in
#: ``clip_grad_norm_(norm_type=inf)``'s DTensor redistribute), which left the run NOT RUN.
CLIP_PLAN: RolePlan = {"main": (("default", "nested_wrapped"),)}


def validate(spec: HookSpec) -> Tuple[str, ...]:
    """An ``AllGather`` comm (``allocate`` and ``__call__``), or a zero-argument factory of one; exact.

    Raises :class:`SpecError` for a ``reduce_dtype`` or ``lossy=`` claim: FSDP2 gathers parameters in the
    parameter dtype and reduces nothing here, and an all-gather that changes a bit corrupts the parameters.
    """
    no_strategies(spec)
    if spec.reduce_dtype is not None or spec.lossy is not None:
        raise SpecError(f"HookSpec {spec.name!r}: api='fsdp2_all_gather' takes no reduce_dtype and no lossy "
                        "contract: FSDP2 all-gathers the parameter shards in the parameter dtype and reduces "
                        "nothing, and an all-gather must move them bit for bit")
    is_comm = not isinstance(spec.hook, type) and callable(getattr(spec.hook, "allocate", None))
    if not is_comm and not binds_signature(spec.hook, 0):
        raise SpecError(
            f"HookSpec {spec.name!r}: for api='fsdp2_all_gather' the hook is an AllGather comm (an object with "
            "allocate() and __call__(output_tensor, input_tensor, group, async_op)) or a factory called with no "
            f"arguments that returns one; got {qualname(spec.hook)}{signature_text(spec.hook)}")
    refuse_unfit_comm(spec, "fsdp2_all_gather", ALL_GATHER_CALL, "fsdp2", REDUCE_SCATTER_CALL,
                      "a ReduceScatter comm: FSDP2 passes it op")
    return ()


def _by_role(plan: RolePlan) -> Any:
    """A case plan: per spec, ``plan[role]`` at each world size by its role, then ``plan["hsdp"]`` at the HSDP
    world size (its pool, 4 ranks on the default CPU run)."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        out = []
        for spec in specs:
            roles = [(settings.role(ws), ws) for ws in settings.world_sizes]
            roles.append(("hsdp", hsdp_world_size(settings.world_sizes)))
            for role, ws in roles:
                out.extend(test.case(spec.name, config, ws, model=model, nodes=role_nodes(role))
                           for config, model in plan.get(role, ()))
        return with_skips(SETUP, out, specs, settings)

    return cases


#: A suite test of the API: ``_test(check, rank_check, plan, kind=...)``.
_test = functools.partial(SuiteTest, "fsdp2_all_gather", "config")

APIS = (
    HookApi(name="fsdp2_all_gather", installed_with="FSDPModule.set_custom_all_gather(comm)",
            variant_field="config", stateful=False, validate=validate,
            builtin_hooks="conformance.apis.fsdp2_all_gather.builtin_hooks:FSDP2_ALL_GATHER_HOOKS",
            models="conformance.apis.fsdp2_all_gather.models:AllGatherModels",
            catalogue_plan=catalogue_plan(SETUP, "default"),
            # "plain", not "exact": no failure here ends with how to declare a LossyContract (validate refuses one)
            plans={"test_fsdp2_all_gather_parity": _test("fsdp2_all_gather_parity", "parity", _by_role(PLAN)),
                   "test_fsdp2_all_gather_long_run": _test(
                       "fsdp2_all_gather_long_run", "long_run", role_plan(SETUP, LONG_RUN_PLAN, exact),
                       depth_params=LONG_RUN_STEPS),
                   "test_fsdp2_all_gather_switches": _test(
                       "fsdp2_all_gather_switches", "long_run", switch_plan(role_plan(SETUP, LONG_RUN_PLAN, exact)),
                       kind="switches"),
                   "test_fsdp2_all_gather_hard_params": _test("fsdp2_all_gather_hard_params", "hard_params",
                                                              _by_role(HARD_PARAMS_PLAN)),
                   "test_fsdp2_all_gather_accumulation": _test(
                       "fsdp2_all_gather_accumulation", "parity", role_plan(SETUP, ACCUMULATION_PLAN, exact),
                       params={"micro_steps": ACCUMULATION_MICRO_STEPS}),
                   "test_fsdp2_all_gather_clip_grad_norm": _test(
                       "fsdp2_all_gather_clip_grad_norm", "clip_grad_norm",
                       role_plan(SETUP, CLIP_PLAN, exact, first_only=True)),
                   "test_fsdp2_all_gather_registration": _test(
                       "fsdp2_all_gather_registration", "registration", registration_plan(
                           SETUP.setter, "default", REGISTRATION_RULES, lambda settings: (settings.world_size,)))},
            checks={"registration": "conformance.apis.fsdp2_all_gather.models:registration",
                    "hard_params": "conformance.apis.fsdp2_all_gather.models:hard_params"}),
)
