"""The ``fsdp`` adapter (``FullyShardedDataParallel.register_comm_hook``): validation, case plans, checks.

Every check builds FSDP models on this rank's device in the pool's process
group, trains them for a few SGD steps with rank-dependent inputs, and returns
findings. The reference for each claim is the native FSDP path with no hook:
``_reduce_grad`` / ``_reduce_grad_no_shard`` in
``torch/distributed/fsdp/_runtime_utils.py`` (pre-divide, SUM reduce, post-
divide), run under ``MixedPrecision(reduce_dtype=X)`` for a ``reduce_dtype=X``
claim.

Checks (each registered with :func:`conformance.ranks.checks.rank_check`):

* ``fsdp.averaging``: analytic ``Linear(1, world_size)``, input = rank; every
  gradient element must equal ``mean(0..world_size-1)`` exactly.
* ``fsdp.parity``: gradients and parameters bitwise equal to the native path
  after every step; the hook's own output in the parameter dtype.
* ``fsdp.rank_grads``: the hooked model's gradients, returned for a
  cross-rank comparison on the controller (rank consistency).
* ``fsdp.registration``: ``register_comm_hook``'s contract with the hook under test.
* ``fsdp.hard_inputs``: caller-supplied gradients (overflow threshold, zeros,
  NaN/Inf, subnormals), bitwise against the native path.
* the lossy-contract checks (``fsdp.lossy_error``, ``fsdp.lossy_loss``,
  ``fsdp.lossy_determinism``) are ``conformance/ranks/checks/lossy.py``'s, driving the
  FSDP models of :func:`lossy_models`. A spec with ``lossy=LossyContract(...)``
  gets those instead of the exact checks (averaging, parity, subgroup parity,
  clip_grad_norm_, hard inputs), and keeps the structural ones: the
  registration rules and rank consistency under ``NO_SHARD``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.apis import CasePlan, HookApi, SuiteTest
from conformance.cases import CaseParams
from conformance.ranks.checks import lossy, rank_check
from conformance.ranks.checks.common import (Lockstep, averaging_findings, clip_grad_norm_parity, fqn_without_wrappers,
                                       grads_per_step, lockstep, named_grads, named_params, train_alone, train_step)
from conformance.ranks.checks.groups import on_subgroup, subgroup_world_size
from conformance.ranks.checks.probe import Example, run_examples
from conformance.ranks.compare import dtype_name
from conformance.apis.fsdp.arithmetic import FsdpArithmetic
from conformance.ranks.diagnosis import CallLog, HookCall, counting_collectives, diagnose
from conformance.protocol import CheckResult, Finding
from conformance.spec import FSDP_STRATEGIES, SpecError, qualname, signature_text, strategies_from_signature

def fsdp_classes():
    """``(FullyShardedDataParallel, MixedPrecision, ShardingStrategy)``, imported when a check runs."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    return FullyShardedDataParallel, MixedPrecision, ShardingStrategy


def native_mixed_precision(reduce_dtype: Optional[torch.dtype]) -> Any:
    """``MixedPrecision(reduce_dtype=X)``, the native path a ``reduce_dtype=X`` hook must equal.

    ``_module_classes_to_ignore`` is emptied: by default FSDP puts batch-norm
    modules in their own FSDP units that reduce in full precision, which
    changes the unit structure between the reference and the hooked model and
    is not something a communication hook can (or should) reproduce.
    """
    if reduce_dtype is None:
        return None
    _, MixedPrecision, _ = fsdp_classes()
    mp = MixedPrecision(reduce_dtype=reduce_dtype)
    if hasattr(mp, "_module_classes_to_ignore"):
        mp = MixedPrecision(reduce_dtype=reduce_dtype, _module_classes_to_ignore=())
    return mp


class HookRecorder:
    """Calls the hook under test and records what it left behind.

    FSDP casts a reduced gradient back to the parameter dtype itself unless the
    registered hook is one of its built-in low-precision hooks
    (``_low_precision_hook_enabled``), so the gradient dtype after backward
    says nothing about the hook. The recorder sees the hook's own output
    (``grad`` for ``NO_SHARD``, ``output`` for sharded strategies) before FSDP
    touches it. It compares equal to the wrapped hook, so FSDP's
    ``state._comm_hook in LOW_PRECISION_HOOKS`` test answers exactly as it
    would for the bare hook and FSDP's behaviour is unchanged.
    """

    def __init__(self, hook: Any):
        self.hook = hook
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.log = CallLog()

    def __call__(self, state: Any, grad: torch.Tensor, *rest: Any) -> Any:
        index = sum(1 for c in self.calls if c["step"] == self.step)
        call = self.log.add(HookCall(self.step, index, f"call {index} ({grad.numel()} elements)",
                                     grad.detach().reshape(-1).clone(), sharded=bool(rest)))
        with counting_collectives() as count:
            result = self.hook(state, grad, *rest)
        out = rest[0] if rest else grad
        call.output, call.collectives = out.detach().reshape(-1).clone(), count[0]
        self.calls.append({"step": self.step, "dtype": out.dtype, "shape": tuple(out.shape)})
        return result

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.hook or other == self.hook

    def __hash__(self) -> int:
        return hash(self.hook)


def build_fsdp(model_name: str, ctx: Any, strategy: str, *, mixed_precision: Any = None,
               use_orig_params: bool = True) -> nn.Module:
    from conformance.models import get_model

    _, _, ShardingStrategy = fsdp_classes()
    return get_model(model_name).build(
        group=ctx.group,
        device=ctx.device,
        fsdp_kwargs=dict(
            sharding_strategy=ShardingStrategy[strategy],
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
        ),
    )


def _hooked(spec: Any, model_name: str, ctx: Any, strategy: str, **kw: Any):
    model = build_fsdp(model_name, ctx, strategy, **kw)
    recorder = HookRecorder(spec.hook)
    model.register_comm_hook(spec.state(ctx.group), recorder)
    return model, recorder


def _recorder_findings(recorder: HookRecorder, model: nn.Module, *, rank: int, step: int,
                       param_dtype: Optional[torch.dtype] = None, step_done: bool = True) -> List[Finding]:
    """What the recorder saw in ``step``: the hook's output left in a dtype other than ``param_dtype`` (the
    parameters' by default; ``MixedPrecision.param_dtype`` under mixed precision), and, once the step is
    done (``step_done``), a step in which the hook was never called."""
    param_dtype = param_dtype or next(model.parameters()).dtype
    findings = []
    for call in recorder.calls:
        if call["step"] == step and call["dtype"] != param_dtype:
            findings.append(Finding(
                rank,
                f"the hook left its reduced gradient in {dtype_name(call['dtype'])}, "
                f"but the parameters are {dtype_name(param_dtype)}: a reduced-precision "
                "hook must cast back to the parameter dtype (as LowPrecisionState.parameter_type does); "
                "FSDP only skips its own cast for its built-in fp16/bf16 hooks",
                step=step))
            break
    if step_done and not any(c["step"] == step for c in recorder.calls):
        findings.append(Finding(rank, "FSDP never called the hook in this step", step=step))
    return findings


@rank_check("fsdp.averaging")
def averaging(ctx: Any, spec: Any, *, strategy: str, steps: int = 4, lr: float = 0.1) -> List[Finding]:
    """Seed ``test_default_communication_hook_behavior``: grads equal mean(0..world_size-1).

    A hook whose result equals each rank's own local gradient on every rank is
    reported as such (:func:`~conformance.ranks.checks.common.averaging_findings`); the
    diagnosis (:func:`conformance.ranks.diagnosis.diagnose`) says whether it communicated.
    """
    from conformance.models import get_model

    model_cls = get_model("analytic_linear")
    ctx.phase("building the hooked analytic model")
    model, recorder = _hooked(spec, "analytic_linear", ctx, strategy)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    for step in range(steps):
        recorder.step = step
        train_step(ctx, "hooked", step, model, optim, inputs, model_cls.loss)
        findings = averaging_findings(ctx, named_grads(model), step, skip_missing=True)
        if ctx.any_rank(bool(findings)):
            ctx.phase(f"step {step}: diagnosing the difference")
            return findings + diagnose(ctx, FsdpArithmetic(ctx.world_size, spec.reduce_dtype), recorder.log, step)
        optim.step()
    return []


@rank_check("fsdp.parity")
def parity(ctx: Any, spec: Any, *, strategy: str, model: str, steps: int = 3, lr: float = 0.01,
           reference_only: bool = False, subgroup: bool = False) -> List[Finding]:
    """Bitwise parity with the native path, gradients and parameters, every step; with ``subgroup``, both
    models (and the hook's state) on this rank's data-parallel subgroup (:func:`on_subgroup`), not WORLD."""
    from conformance.models import get_model

    if subgroup:
        ctx = on_subgroup(ctx)
    model_cls = get_model(model)
    ctx.phase("building the reference model (no hook)")
    ref = build_fsdp(model, ctx, strategy, mixed_precision=native_mixed_precision(spec.reduce_dtype))
    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    if reference_only:
        opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        return train_alone(ctx, ref, opt_ref, inputs, model_cls.loss, steps)
    ctx.phase("building the hooked model")
    return lockstep(ctx, _against_native(ctx, spec, strategy, model, ref, inputs), steps=steps, lr=lr)


@rank_check("fsdp.clip_grad_norm")
def clip_grad_norm(ctx: Any, spec: Any, *, strategy: str, model: str, steps: int = 2, lr: float = 0.01,
                   low_precision_grads: bool = False, reference_only: bool = False) -> List[Finding]:
    """``FullyShardedDataParallel.clip_grad_norm_`` with the hook registered, for norm types 2 and inf: the
    total norm and the clipped gradients bitwise equal to the native path's (PyTorch's
    test_fsdp_clip_grad_norm.py), the parameters after each step too; then, as its ``test_no_gradients``,
    a forward with no backward: the same total norm (a float32 zero) and the same warning.

    ``low_precision_grads``: both models under :func:`low_precision_grads_mixed_precision` (its
    ``test_low_precision_grads``: float16 gradients kept, so the total norm is float16 too).
    """
    from conformance.models import get_model

    model_cls = get_model(model)
    mixed = low_precision_grads_mixed_precision() if low_precision_grads else native_mixed_precision(spec.reduce_dtype)

    def make_reference() -> Tuple[nn.Module, Any, Any]:
        ctx.phase("building the reference model (no hook)")
        ref = build_fsdp(model, ctx, strategy, mixed_precision=mixed)
        return ref, model_cls.make_input(ctx.rank, ctx.world_size, ctx.device), model_cls.loss

    def make_plan() -> Lockstep:
        ref, inputs, _ = make_reference()
        ctx.phase("building the hooked model")
        return _against_native(ctx, spec, strategy, model, ref, inputs,
                               mixed_precision=mixed if low_precision_grads else None)

    return clip_grad_norm_parity(ctx, make_plan, steps=steps, lr=lr,
                                 clip=lambda m, max_norm, norm_type: m.clip_grad_norm_(max_norm, norm_type),
                                 without_backward=lambda plan: plan.inputs,
                                 make_reference=make_reference if reference_only else None)


def low_precision_grads_mixed_precision() -> Any:
    """``MixedPrecision(param_dtype=float16, reduce_dtype=float16, keep_low_precision_grads=True)``, the setting of
    ``test_low_precision_grads`` in PyTorch's test_fsdp_clip_grad_norm.py: forward and backward in float16,
    the gradients kept in float16 after the reduction.

    ``reduce_dtype`` is float16, as there (the plan skips hooks that claim another); the reduction of a hook
    that claims none, which keeps its input's dtype, is float16 too. The reference and the hooked model get
    the same setting: FSDP casts the gradient to ``reduce_dtype`` before it calls a hook.
    """
    _, MixedPrecision, _ = fsdp_classes()
    kw: Dict[str, Any] = dict(param_dtype=torch.float16, keep_low_precision_grads=True, reduce_dtype=torch.float16)
    try:
        return MixedPrecision(**kw, _module_classes_to_ignore=())
    except TypeError:
        return MixedPrecision(**kw)


def _against_native(ctx: Any, spec: Any, strategy: str, model: str, ref: nn.Module, inputs: Any,
                    context: Optional[Any] = None, mixed_precision: Any = None) -> Lockstep:
    """The lock-step plan of the hooked ``model`` (under ``mixed_precision``, none by default) against
    ``ref``, the native path: gradients after each backward, parameters after each optimizer step, and what
    the recorder saw the hook do."""
    from conformance.models import get_model

    hooked, recorder = _hooked(spec, model, ctx, strategy, mixed_precision=mixed_precision)

    def start_step(step: int) -> None:
        recorder.step = step

    return Lockstep(
        ref=ref, hooked=hooked, inputs=inputs, loss_fn=get_model(model).loss, reference="the native path",
        grads=[("gradient", named_grads, "")], params=("parameter after the optimizer step", named_params, ""),
        hook_findings=lambda step: _recorder_findings(recorder, hooked, rank=ctx.rank, step=step,
                                                      param_dtype=getattr(mixed_precision, "param_dtype", None)),
        findings_so_far=lambda step: _recorder_findings(recorder, hooked, rank=ctx.rank, step=step, step_done=False,
                                                        param_dtype=getattr(mixed_precision, "param_dtype", None)),
        start_step=start_step, context=context, reduce_dtype=spec.reduce_dtype,
        diagnose=lambda step: diagnose(ctx, FsdpArithmetic(ctx.world_size, spec.reduce_dtype), recorder.log, step))


@rank_check("fsdp.rank_grads")
def rank_grads(ctx: Any, spec: Any, *, strategy: str, model: str, steps: int = 3,
               lr: float = 0.01) -> CheckResult:
    """The hooked model's gradients after each step, for a cross-rank comparison (:func:`grads_per_step`)."""
    from conformance.models import get_model

    model_cls = get_model(model)
    ctx.phase("building the hooked model")
    hooked, recorder = _hooked(spec, model, ctx, strategy)

    def start_step(step: int) -> None:
        recorder.step = step

    return grads_per_step(ctx, hooked, torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9),
                          model_cls.make_input(ctx.rank, ctx.world_size, ctx.device), model_cls.loss, steps,
                          named=named_grads, start_step=start_step)


# -- lossy contracts ------------------------------------------------------------------


def _summoned(model: nn.Module, with_grads: bool) -> Dict[str, Optional[torch.Tensor]]:
    """Every parameter (``with_grads``: its gradient) unsharded, by FQN, copied out of
    ``FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=...)``.

    Collective (all-gathers over each FSDP unit's process group), so every rank calls it at the same point.
    ``with_grads`` needs ``use_orig_params=True``, which :func:`build_fsdp` sets; under ``NO_SHARD`` it
    gathers nothing. A gradient FSDP leaves as ``None`` on every rank stays ``None``.
    """
    FSDP, _, _ = fsdp_classes()
    with FSDP.summon_full_params(model, writeback=False, with_grads=with_grads):
        out: Dict[str, Optional[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            t = p.grad if with_grads else p
            out[fqn_without_wrappers(name)] = None if t is None else t.detach().clone()
        return out


def lossy_models(ctx: Any, spec: Any, *, strategy: str, model: str) -> lossy.LossyModels:
    """The FSDP models of the lossy-contract checks (:class:`conformance.ranks.checks.lossy.LossyModels`) under
    ``strategy``, with ``use_orig_params=True``.

    The hook is registered through its :class:`HookRecorder`, whose findings (never called, its output left
    in another dtype than the parameters') join the lossy error's. Under the sharded strategies the full
    gradients are gathered with ``summon_full_params(with_grads=True)`` (:func:`_summoned`): the contract
    bounds each parameter's relative error, and a shard's (or a flat parameter's) relative error is another
    number; under ``NO_SHARD`` every rank holds them whole already. The loss
    reference is the native path in full precision (no hook, no ``MixedPrecision``).
    """
    from conformance.models import get_model

    model_cls = get_model(model)

    def hooked_model() -> lossy.HookedModel:
        hooked, recorder = _hooked(spec, model, ctx, strategy)

        def run_step(step: int, run: Any) -> None:
            recorder.step = step
            run()

        return lossy.HookedModel(hooked, run_step,
                                 lambda step: _recorder_findings(recorder, hooked, rank=ctx.rank, step=step))

    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    if strategy == "NO_SHARD":
        # Already unsharded: every rank holds whole parameters and gradients, no all-gather needed.
        full_grads, full_params = named_grads, named_params
    else:
        full_grads, full_params = (lambda m: _summoned(m, with_grads=True)), (lambda m: _summoned(m, with_grads=False))
    return lossy.LossyModels(
        model_cls=model_cls, build_hooked=hooked_model, build_native=lambda: build_fsdp(model, ctx, strategy),
        inputs=inputs, micro_inputs=[inputs], train=train_step, full_grads=full_grads, full_params=full_params)


lossy.register("fsdp", lossy_models)


# -- hard inputs ----------------------------------------------------------------------

@rank_check("fsdp.hard_inputs")
def hard_inputs(ctx: Any, spec: Any, *, strategy: str, examples: Sequence[Example], case_id: str,
                fresh: bool = True) -> List[Finding]:
    """Chosen gradients through the probe (:func:`conformance.ranks.checks.probe.run_examples`), bitwise vs native."""
    def make_plan(inputs: Any, context: Any) -> Lockstep:
        ctx.phase("building the reference probe (no hook)")
        ref = build_fsdp("gradient_probe", ctx, strategy, mixed_precision=native_mixed_precision(spec.reduce_dtype))
        ctx.phase("building the hooked probe")
        plan = _against_native(ctx, spec, strategy, "gradient_probe", ref, inputs, context)
        return dataclasses.replace(plan, params=None)

    return run_examples(ctx, case_id, examples, fresh, make_plan)


# -- the API: validation and case plans ----------------------------------------------

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


def validate(spec: Any) -> Tuple[str, ...]:
    """FSDP calls ``hook(state, grad)`` under NO_SHARD and ``hook(state, grad, output)`` when sharded.

    Returns the strategies the spec is checked under: ``spec.strategies``, or
    every one its hook's signature serves. Raises :class:`SpecError` naming
    the strategy and the signature that do not fit.
    """
    supported = strategies_from_signature(spec.hook)
    if not supported:
        raise SpecError(
            f"HookSpec {spec.name!r}: hook {qualname(spec.hook)}{signature_text(spec.hook)} "
            "accepts neither (state, grad) for NO_SHARD nor (state, grad, output) for "
            "sharded strategies"
        )
    if spec.strategies is None:
        return supported
    strategies = (spec.strategies,) if isinstance(spec.strategies, str) else tuple(spec.strategies)
    unknown = [s for s in strategies if s not in FSDP_STRATEGIES]
    if unknown or not strategies:
        raise SpecError(
            f"HookSpec {spec.name!r}: unknown strategies {unknown or strategies!r}; "
            f"expected names from {', '.join(FSDP_STRATEGIES)}"
        )
    unfit = [s for s in strategies if s not in supported]
    if unfit:
        raise SpecError(
            f"HookSpec {spec.name!r}: strategies {unfit} need a hook signature of "
            f"{'(state, grad)' if 'NO_SHARD' in unfit else '(state, grad, output)'}, but the "
            f"hook is {qualname(spec.hook)}{signature_text(spec.hook)}"
        )
    return strategies


def _training(test: SuiteTest, specs: Sequence[Any], settings: Any, models: Optional[Dict[str, Sequence[str]]] = None,
              *, strategies: Optional[Sequence[str]] = None, skip: Optional[str] = None) -> List[CaseParams]:
    """Every spec x strategy it serves x world size (x model, ``models[role]``), in that order.

    ``strategies`` restricts the strategies; ``skip`` is the reason a case at
    world size 1 cannot run (``None``: it can).
    """
    out = []
    for spec in specs:
        for strategy in spec.strategies or ():
            if strategies is not None and strategy not in strategies:
                continue
            for ws in settings.world_sizes:
                why = skip if ws < 2 else None
                for model in (None,) if models is None else models[settings.role(ws)]:
                    out.append(test.case(spec.name, strategy, ws, model=model, skip=why))
    return out


def _registration(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
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


def _subgroup(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """Parity on data-parallel subgroups (``conformance.ranks.checks.groups``): every strategy a spec serves, on
    the smallest even pool of at least four ranks (the run's, else the extra pool FSDP2's HSDP starts)."""
    ws = subgroup_world_size(settings.world_sizes)
    return [test.case(spec.name, strategy, ws, model=SUBGROUP_MODEL) for spec in specs
            for strategy in spec.strategies or ()]


def _low_precision_clip(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """:data:`LOW_PRECISION_CLIP` at every world size (a float16 sum of three rounds where one of two is
    exact); skipped for a hook that claims a reduce dtype
    other than float16, the one ``test_low_precision_grads`` pins."""
    out = []
    for case in _training(test, specs, settings, {"main": LOW_PRECISION_CLIP[1:], "extra": LOW_PRECISION_CLIP[1:]},
                          strategies=LOW_PRECISION_CLIP[0]):
        claim = next(spec.reduce_dtype for spec in specs if spec.name == case.hook)
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


def _exact(spec: Any) -> bool:
    return spec.lossy is None


def _of(keep: Callable[[Any], bool], plan: CasePlan) -> CasePlan:
    """``plan`` over the specs ``keep`` selects: exact claims get the exact checks, lossy contracts theirs."""
    return lambda test, specs, settings: plan(test, [spec for spec in specs if keep(spec)], settings)


def _first_world_size(plan: CasePlan) -> CasePlan:
    """``plan`` at the run's first world size only (a training-loss or determinism case: not about rounding)."""
    return lambda test, specs, settings: [c for c in plan(test, specs, settings)
                                          if c.world_size == settings.world_sizes[0]]


#: A suite test of this API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "fsdp", "strategy")


API = HookApi(
    name="fsdp",
    installed_with="FullyShardedDataParallel.register_comm_hook(state, hook)",
    variant_field="strategy",
    stateful=True,
    validate=validate,
    builtin_hooks="conformance.apis.fsdp.builtin_hooks:FSDP_HOOKS",
    default_hook="conformance.apis.fsdp.builtin_hooks:default_hook",
    plans={
        "test_averaging": _test("averaging", "averaging", _of(_exact, _training), kind="exact"),
        "test_parity": _test("parity", "parity", _of(_exact, functools.partial(
            _training, models={"main": PARITY_MODELS, "extra": EXTRA_PARITY_MODELS})), kind="exact"),
        "test_rank_consistency": _test("rank_consistency", "rank_grads", functools.partial(
            _training, models={"main": CONSISTENCY_MODELS, "extra": CONSISTENCY_MODELS[:1]}, strategies=("NO_SHARD",),
            skip="rank consistency needs at least 2 ranks"), kind="across_ranks"),
        "test_registration": _test("registration", "registration", _registration),
        "test_hard_inputs": _test("hard_inputs", "hard_inputs", _of(_exact, _training), kind="hard_inputs"),
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

from conformance.apis.fsdp import registration  # noqa: E402,F401  (registers fsdp.registration)
