"""The ``ddp`` adapter (``DistributedDataParallel.register_comm_hook``): validation, case plans, checks.

DDP calls ``hook(state, bucket)`` once per gradient bucket of a synchronising
backward; the hook returns a ``torch.futures.Future`` whose value is the
bucket's new contents, which DDP copies back into the parameters' gradients.
Every check wraps DDP around a freshly built reference model (plain module,
same seed on every rank) in the pool's process group, trains it with
rank-dependent inputs for a few SGD steps and returns findings.

The reference for each claim:

* full precision (``reduce_dtype=None``): the same DDP model with no hook
  (``Reducer``: copy the gradient into the bucket divided by the world size,
  SUM all-reduce);
* ``reduce_dtype=float16`` / ``bfloat16``: the same DDP model with
  ``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``
  registered, which PyTorch documents as equal to ``fp16_compress_hook`` /
  ``bf16_compress_hook`` (``ddp_comm_hooks/default_hooks.py``);
* a lossy hook (``HookSpec(lossy=LossyContract(...))``): the exact mean over
  ranks of the same local gradients, computed in float64; the hook is held to
  the promises of its contract instead of bit-for-bit equality.

Training configurations (``config``, see :data:`CONFIGS`): ``default``,
``small_buckets`` (a bucket cap that forces several buckets), ``bucket_per_param``
(a bucket per parameter, of uneven lengths), ``subgroup`` (DDP, and the hook's
state, on a data-parallel subgroup of the pool, not WORLD), ``bucket_view``
(``gradient_as_bucket_view=True``), ``static_graph``, ``find_unused``
(``find_unused_parameters=True`` on a model that leaves parameters unused) and
``no_sync`` (gradient accumulation under ``no_sync()`` before a synchronising
step).

Checks (each registered with :func:`conformance.ranks.checks.rank_check`):

* ``ddp.averaging``: analytic ``Linear(1, world_size)``, input = rank; every
  gradient element must equal ``mean(0..world_size-1)`` exactly (or, for a
  reduced-precision claim, the documented equivalent's result);
* ``ddp.parity``: gradients and parameters bitwise equal to the reference
  after every step, per parameter FQN;
* ``ddp.rank_grads``: the hooked model's gradients per step, returned for a
  cross-rank comparison on the controller;
* ``ddp.future_contract``: DDP accepts the bare hook, and every future's value
  is a tensor with the bucket buffer's shape, dtype and device (the contract and
  its recorder are in ``conformance/apis/ddp/future.py``);
* the lossy-contract checks (``ddp.lossy_error``, ``ddp.lossy_loss``,
  ``ddp.lossy_determinism``) are ``conformance/ranks/checks/lossy.py``'s, driving the
  DDP models of :func:`lossy_models`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.apis import CasePlan, HookApi, SuiteTest, called_as
from conformance.cases import CaseParams
from conformance.ranks.checks import rank_check
from conformance.ranks.checks.common import (Lockstep, averaging_findings, clip_grad_norm_parity, fqn_inside_ddp,
                                       grads_per_step, lockstep, named_grads, named_params, train_alone)
from conformance.apis.ddp.future import DDPHookRecorder, hook_called, hooked_step
from conformance.apis.ddp.reference import reference_hook, reference_name
from conformance.ranks.checks import lossy
from conformance.ranks.checks.groups import on_subgroup, subgroup_world_size
from conformance.ranks.checks.probe import Example, run_examples
from conformance.ranks.compare import dtype_name
from conformance.apis.ddp.arithmetic import DdpArithmetic
from conformance.ranks.diagnosis import diagnose
from conformance.protocol import CheckResult, Finding

#: ``bucket_cap_mb`` of the ``small_buckets`` config: 512 bytes, so every
#: reference model spreads over several buckets once DDP rebuilds its buckets
#: after the first iteration (the first iteration always uses one bucket).
SMALL_BUCKET_CAP_MB = 512 / (1024 * 1024)
#: ``bucket_cap_mb`` of the ``bucket_per_param`` config: one byte, so from the
#: second iteration on every parameter is a bucket of its own, and the buckets
#: of ``gradient_probe`` (numels 3, 1, 5, 21, 64) have lengths that divide by
#: neither 2 nor 3 ranks (a hook that pads a bucket must not hand the padding back).
BUCKET_PER_PARAM_CAP_MB = 1 / (1024 * 1024)
#: Backward passes per step in the ``no_sync`` config: all but the last run
#: under ``no_sync()`` (no hook call), the last one synchronises.
NO_SYNC_MICRO_STEPS = 3

#: Training configurations: DDP constructor keyword arguments.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "small_buckets": {"bucket_cap_mb": SMALL_BUCKET_CAP_MB},
    "bucket_per_param": {"bucket_cap_mb": BUCKET_PER_PARAM_CAP_MB},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    "no_sync": {},
    "subgroup": {},
}

def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


# -- building ------------------------------------------------------------------------

def build_ddp(model_name: str, ctx: Any, config: str) -> nn.Module:
    """``DistributedDataParallel`` around a freshly built ``model_name`` under ``config``."""
    from conformance.models import get_model

    if config not in CONFIGS:
        raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(CONFIGS)}")
    module = get_model(model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    device_ids = [ctx.device] if ctx.device.type == "cuda" else None
    return _ddp_class()(module, device_ids=device_ids, process_group=ctx.group, **CONFIGS[config])


def build_reference(spec: Any, model_name: str, ctx: Any, config: str) -> nn.Module:
    model = build_ddp(model_name, ctx, config)
    ref = reference_hook(spec.reduce_dtype, next(model.parameters()).dtype)
    if ref is not None:
        state_factory, hook = ref
        model.register_comm_hook(state_factory(ctx.group), hook)
    return model


def _names(model: nn.Module) -> Dict[int, str]:
    return {id(p): fqn_inside_ddp(n) for n, p in model.named_parameters()}


def build_hooked(spec: Any, model_name: str, ctx: Any, config: str) -> Tuple[nn.Module, DDPHookRecorder]:
    model = build_ddp(model_name, ctx, config)
    recorder = DDPHookRecorder(spec.hook, ctx.rank, _names(model))
    model.register_comm_hook(spec.state(ctx.group), recorder)
    return model, recorder


# -- training -------------------------------------------------------------------------

def micro_inputs(model_cls: Any, ctx: Any, config: str) -> List[Tuple[torch.Tensor, ...]]:
    """Inputs of each backward pass of one step: one, or :data:`NO_SYNC_MICRO_STEPS` for ``no_sync``.

    Every micro-step's input is rank-dependent and distinct
    (``make_input(rank + k * world_size)``).
    """
    count = NO_SYNC_MICRO_STEPS if config == "no_sync" else 1
    return [model_cls.make_input(ctx.rank + k * ctx.world_size, ctx.world_size, ctx.device) for k in range(count)]


def train_step(ctx: Any, label: str, step: int, model: nn.Module, optim: torch.optim.Optimizer,
               inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Any) -> None:
    """Zero the gradients, then forward/backward every micro-step; all but the last under ``no_sync()``."""
    optim.zero_grad(set_to_none=True)
    for k, micro in enumerate(inputs):
        last = k == len(inputs) - 1
        ctx.phase(f"step {step}: forward/backward of the {label} model"
                  + ("" if len(inputs) == 1 else f" (micro-step {k}{'' if last else ', no_sync'})"))
        if last:
            loss_fn(micro, model(*micro)).backward()
        else:
            with model.no_sync():
                loss_fn(micro, model(*micro)).backward()


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return named_grads(model, fqn_inside_ddp)


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return named_params(model, fqn_inside_ddp)



# -- checks -----------------------------------------------------------------------------

@rank_check("ddp.averaging")
def averaging(ctx: Any, spec: Any, *, config: str = "default", model: str = "analytic_linear", steps: int = 4,
              lr: float = 0.1) -> List[Finding]:
    """Seed ``test_default_communication_hook_behavior`` under DDP: grads equal mean(0..world_size-1).

    For a reduced-precision claim the expected value is what the documented
    equivalent computes on the same model. A hook whose result equals each
    rank's own local gradient on every rank is reported as such; the diagnosis
    (:func:`conformance.ranks.diagnosis.diagnose`) says whether it communicated at all.
    """
    from conformance.models import get_model

    model_cls = get_model("analytic_linear")
    ctx.phase("building the hooked analytic model")
    model, recorder = build_hooked(spec, "analytic_linear", ctx, "default")
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    ref = ref_optim = None
    if reference_hook(spec.reduce_dtype, next(model.parameters()).dtype) is not None:
        ctx.phase("building the reference analytic model")
        ref = build_reference(spec, "analytic_linear", ctx, "default")
        ref_optim = torch.optim.SGD(ref.parameters(), lr=lr)
    inputs = [model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)]
    for step in range(steps):
        broken = hooked_step(ctx, recorder, step,
                             lambda: train_step(ctx, "hooked", step, model, optim, inputs, model_cls.loss))
        if broken:
            return broken
        expected = None
        if ref is not None:
            train_step(ctx, "reference", step, ref, ref_optim, inputs, model_cls.loss)
            expected = _grads(ref)
        findings = averaging_findings(
            ctx, _grads(model), step, expected=expected,
            what=f"the {dtype_name(spec.reduce_dtype)} average as {reference_name(spec)} computes it")
        if ctx.any_rank(bool(findings)):  # a "local_gradient" finding is on every rank
            ctx.phase(f"step {step}: diagnosing the difference")
            return findings + diagnose(ctx, arithmetic(ctx, spec), recorder.log, step)
        optim.step()
        if ref_optim is not None:
            ref_optim.step()
    return []


@rank_check("ddp.parity")
def parity(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 3, lr: float = 0.01,
           reference_only: bool = False) -> List[Finding]:
    """Gradients and parameters bitwise equal to the reference DDP model after every step."""
    from conformance.models import get_model

    if config == "subgroup":
        ctx = on_subgroup(ctx)
    model_cls = get_model(model)
    ctx.phase("building the reference DDP model")
    ref = build_reference(spec, model, ctx, config)
    inputs = micro_inputs(model_cls, ctx, config)
    if reference_only:
        opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        return train_alone(ctx, ref, opt_ref, inputs, model_cls.loss, steps, train=train_step)
    return lockstep(ctx, _against_reference(ctx, spec, config, model, ref, inputs), steps=steps, lr=lr)


def _against_reference(ctx: Any, spec: Any, config: str, model: str, ref: nn.Module, inputs: Any,
                       context: Any = None) -> Lockstep:
    """The lock-step plan of the hooked DDP ``model`` against ``ref``: gradients, parameters, and the future
    contract as the recorder saw it (reported even where DDP went on without an error)."""
    from conformance.models import get_model

    ctx.phase("building the hooked DDP model")
    hooked, recorder = build_hooked(spec, model, ctx, config)
    return Lockstep(
        ref=ref, hooked=hooked, inputs=inputs, loss_fn=get_model(model).loss, reference=reference_name(spec),
        grads=[("gradient", _grads, "")], params=("parameter after the optimizer step", _params, ""),
        hook_findings=lambda step: hook_called(ctx, recorder, step) + recorder.findings_of(step), train=train_step,
        guard_hooked=lambda step, run: hooked_step(ctx, recorder, step, run), context=context,
        diagnose=lambda step: diagnose(ctx, arithmetic(ctx, spec), recorder.log, step),
        findings_so_far=recorder.findings_of, reduce_dtype=spec.reduce_dtype)


def arithmetic(ctx: Any, spec: Any) -> DdpArithmetic:
    """DDP's native arithmetic for the hook's claim (:class:`conformance.apis.ddp.arithmetic.DdpArithmetic`): the
    reference of :func:`conformance.apis.ddp.reference.reference_hook` (float32 parameters)."""
    claim = None if spec.reduce_dtype in (None, torch.float32) else spec.reduce_dtype
    return DdpArithmetic(ctx.world_size, claim)


@rank_check("ddp.clip_grad_norm")
def clip_grad_norm(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 2, lr: float = 0.01,
                   reference_only: bool = False) -> List[Finding]:
    """``torch.nn.utils.clip_grad_norm_`` on the DDP model with the hook registered, for norm types 2 and inf:
    the total norm and the clipped gradients bitwise equal to the reference's, the parameters too."""
    from conformance.models import get_model

    model_cls = get_model(model)

    def make_reference() -> Tuple[nn.Module, Any, Any]:
        ctx.phase("building the reference DDP model")
        return build_reference(spec, model, ctx, config), micro_inputs(model_cls, ctx, config), model_cls.loss

    def make_plan() -> Lockstep:
        ref, inputs, _ = make_reference()
        return _against_reference(ctx, spec, config, model, ref, inputs)

    return clip_grad_norm_parity(ctx, make_plan, steps=steps, lr=lr, train=train_step,
                                 make_reference=make_reference if reference_only else None)


@rank_check("ddp.hard_inputs")
def hard_inputs(ctx: Any, spec: Any, *, config: str, examples: Sequence[Example], case_id: str,
                fresh: bool = True, model: str = "gradient_probe") -> List[Finding]:
    """Chosen gradients through the probe (:func:`conformance.ranks.checks.probe.run_examples`), bitwise vs the
    reference, in ``config`` (one bucket, bucket views, a bucket per parameter)."""
    if config == "no_sync":
        raise ValueError("hard inputs feed one backward per step; the no_sync config accumulates several")

    def make_plan(inputs: Any, context: Any) -> Lockstep:
        ctx.phase("building the reference DDP probe")
        ref = build_reference(spec, "gradient_probe", ctx, config)
        plan = _against_reference(ctx, spec, config, "gradient_probe", ref, lambda step: [inputs(step)], context)
        return dataclasses.replace(plan, params=None)

    return run_examples(ctx, case_id, examples, fresh, make_plan)


@rank_check("ddp.rank_grads")
def rank_grads(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 4,
               lr: float = 0.01) -> CheckResult:
    """The hooked model's gradients after each step, for a cross-rank comparison (:func:`grads_per_step`);
    its findings are future-contract violations that stopped the training."""
    from conformance.models import get_model

    model_cls = get_model(model)
    ctx.phase("building the hooked DDP model")
    hooked, recorder = build_hooked(spec, model, ctx, config)
    return grads_per_step(ctx, hooked, torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9),
                          micro_inputs(model_cls, ctx, config), model_cls.loss, steps, named=_grads,
                          train=train_step, guard_hooked=lambda step, run: hooked_step(ctx, recorder, step, run))


def lossy_models(ctx: Any, spec: Any, *, config: str, model: str) -> lossy.LossyModels:
    """The DDP models of the lossy-contract checks (:class:`conformance.ranks.checks.lossy.LossyModels`) in ``config``:
    the hook through its future-contract recorder (a broken contract ends the check, as
    :func:`~conformance.apis.ddp.future.hooked_step` decides), DDP with no hook as the loss reference,
    the gradients of DDP's replicas as they are (DDP does not shard)."""
    from conformance.models import get_model

    model_cls = get_model(model)

    def hooked_model() -> lossy.HookedModel:
        hooked, recorder = build_hooked(spec, model, ctx, config)
        return lossy.HookedModel(hooked, lambda step, run: hooked_step(ctx, recorder, step, run))

    inputs = micro_inputs(model_cls, ctx, config)
    return lossy.LossyModels(
        model_cls=model_cls, build_hooked=hooked_model, build_native=lambda: build_ddp(model, ctx, config),
        inputs=inputs, micro_inputs=inputs, train=train_step, full_grads=_grads, full_params=_params,
        local_grads=_grads, forward=lambda m: m.module)


lossy.register("ddp", lossy_models)


# -- the API: case plans ---------------------------------------------------------------

# (config, model) pairs per world-size role: the main world size gets the spread of real
# training setups; an extra one (3, not a power of two) gets the essentials.
#: Bitwise parity with the reference, for hooks that claim exactness.
PARITY_CASES = (
    ("default", "nested_wrapped"),
    ("default", "transformer_shared"),
    ("small_buckets", "transformer_shared"),
    ("bucket_view", "nested_wrapped"),
    ("static_graph", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "net_flat"),
)
EXTRA_PARITY_CASES = (("default", "nested_wrapped"),)
#: Cross-rank comparison of the gradients.
CONSISTENCY_CASES = (("default", "net_flat"),)
#: The future's value against the bucket buffer: every config, at every world size. The
#: ``gradient_probe`` cases have buckets whose lengths divide by neither 2 nor 3 (94 elements
#: in one bucket, or 3, 1, 5, 21 and 64 in a bucket each), where a padded result shows.
FUTURE_CASES = (
    ("default", "net_flat"),
    ("small_buckets", "nested_wrapped"),
    ("bucket_per_param", "gradient_probe"),
    ("bucket_view", "gradient_probe"),
    ("static_graph", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "gradient_probe"),
)
#: Hard inputs through the probe (exact claims): one bucket, bucket views, a bucket per parameter.
HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_view", "gradient_probe"),
                    ("bucket_per_param", "gradient_probe"))
EXTRA_HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_per_param", "gradient_probe"))
#: clip_grad_norm_ with the hook registered (main world size): one bucket, and a model whose unused
#: parameters have no gradient (find_unused_parameters), as in PyTorch's test_fsdp_clip_grad_norm.py.
CLIP_CASES = (("default", "nested_wrapped"), ("find_unused", "unused_param"))
#: Lossy contracts: relative error and NaN/Inf per step and parameter.
LOSSY_ERROR_CASES = (
    ("default", "transformer_shared"),
    ("small_buckets", "nested_wrapped"),
    ("bucket_view", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "net_flat"),
)
EXTRA_LOSSY_ERROR_CASES = (("default", "nested_wrapped"),)
#: Steps of the rank-consistency cases (their gradients are compared across ranks after each).
RANK_CONSISTENCY_STEPS = 4
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy.
LOSSY_LOSS_CASES = (("default", "transformer_shared"),)
LOSSY_DETERMINISM_CASES = (("default", "net_flat"),)
_ACROSS_RANKS = "needs at least 2 ranks with different inputs"


def _plan(main: Sequence[Tuple[str, str]], extra: Sequence[Tuple[str, str]] = (), *, first_only: bool = False,
          keep: Callable[[Any], bool] = lambda spec: True, skip_one_rank: Optional[str] = None) -> CasePlan:
    """A :data:`~conformance.apis.CasePlan`: per kept spec and world size, the ``(config, model)`` pairs
    of its role (``main`` or ``extra``); only the run's first world size when ``first_only``."""

    def plan(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        sizes = settings.world_sizes[:1] if first_only else settings.world_sizes
        out = []
        for spec in filter(keep, specs):
            for ws in sizes:
                pairs = main if settings.role(ws) == "main" else extra
                why = skip_one_rank if ws < 2 else None
                out.extend(test.case(spec.name, config, ws, model=model, skip=why) for config, model in pairs)
        return out

    return plan


def _with_subgroup(plan: CasePlan) -> CasePlan:
    """``plan``, plus per kept spec one ``subgroup`` case (``nested_wrapped``) on the smallest even pool of
    at least four ranks: the run's, else the extra pool FSDP2's HSDP starts."""
    def with_subgroup(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        ws = subgroup_world_size(settings.world_sizes)
        return plan(test, specs, settings) + [test.case(spec.name, "subgroup", ws, model="nested_wrapped")
                                              for spec in specs if _exact(spec)]

    return with_subgroup


def _exact(spec: Any) -> bool:
    return spec.lossy is None


#: A suite test of this API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "ddp", "config")


API = HookApi(
    name="ddp",
    installed_with="DistributedDataParallel.register_comm_hook(state, hook)",
    variant_field="config",
    stateful=True,
    validate=called_as(2, "a DDP hook is called as hook(state, bucket) and returns a torch.futures.Future"),
    builtin_hooks="conformance.apis.ddp.builtin_hooks:DDP_HOOKS",
    default_hook="conformance.apis.ddp.builtin_hooks:default_hook",
    plans={
        "test_ddp_averaging": _test("averaging", "averaging", _plan(
            [("default", "analytic_linear")], [("default", "analytic_linear")], keep=_exact,
            skip_one_rank=_ACROSS_RANKS), kind="exact"),
        "test_ddp_parity": _test("parity", "parity", _with_subgroup(_plan(PARITY_CASES, EXTRA_PARITY_CASES,
                                                                          keep=_exact)), kind="exact"),
        "test_ddp_rank_consistency": _test("rank_consistency", "rank_grads", _plan(
            CONSISTENCY_CASES, CONSISTENCY_CASES, skip_one_rank=_ACROSS_RANKS), kind="across_ranks",
            params={"steps": RANK_CONSISTENCY_STEPS}),
        "test_ddp_future_contract": _test("future_contract", "future_contract", _plan(FUTURE_CASES, FUTURE_CASES)),
        "test_ddp_hard_inputs": _test("hard_inputs", "hard_inputs", _plan(HARD_INPUT_CASES, EXTRA_HARD_INPUT_CASES,
                                                                          keep=_exact), kind="hard_inputs"),
        "test_ddp_clip_grad_norm": _test("clip_grad_norm", "clip_grad_norm", _plan(CLIP_CASES, keep=_exact)),
        "test_ddp_lossy_error": _test("lossy_error", "lossy_error", _plan(
            LOSSY_ERROR_CASES, EXTRA_LOSSY_ERROR_CASES, keep=lambda sp: not _exact(sp)), kind="lossy_error"),
        "test_ddp_lossy_loss": _test("lossy_loss", "lossy_loss", _plan(
            LOSSY_LOSS_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.loss_margin is not None),
            kind="lossy_loss"),
        "test_ddp_lossy_determinism": _test("lossy_determinism", "lossy_determinism", _plan(
            LOSSY_DETERMINISM_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.deterministic),
            kind="lossy_determinism"),
    },
)
APIS = (API,)
