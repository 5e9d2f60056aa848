"""The FSDP2 adapter (``fully_shard`` custom comms, HSDP all-reduce hooks): validation, case plans, checks.

``api="fsdp2"``: ``FSDPModule.set_custom_reduce_scatter(comm)``. FSDP2 hands the
comm a flat buffer it allocated with ``comm.allocate`` (already in the reduce
dtype and already pre-divided where FSDP pre-divides) and calls
``comm(output_tensor=..., input_tensor=..., group=..., op=...)`` from
``foreach_reduce`` (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``).
The ``op`` carries the averaging: ``_get_gradient_divide_factors`` picks

* float32/bfloat16 reduce dtype: ``ReduceOp.AVG`` (no divide by FSDP), or
  ``ReduceOp.PREMUL_SUM(1/factor)`` after ``set_gradient_divide_factor(factor)``
  (``AVG`` again when ``factor`` equals the shard group size);
* float16 (overflow risk), or ``set_force_sum_reduction_for_comms(True)``:
  ``ReduceOp.SUM``, with FSDP dividing before (float16 only: the power of two
  ``DefaultState`` would use) and after the collective.

So a comm conforms when it reduces with the ``op`` it is given, over the
``group`` it is given, into ``output_tensor``, and ``allocate`` returns exactly
what was asked for. The reference is the same model under ``fully_shard`` with
no custom comm and the same ``MixedPrecisionPolicy(reduce_dtype=...)``: the
spec's claim ``reduce_dtype=X`` means "correct when FSDP2 reduces in X".

``api="fsdp2_all_reduce"``: ``FSDPModule.set_all_reduce_hook(hook)`` under native
HSDP (a 2-D replicate x shard mesh). FSDP2 calls ``hook(reduce_output)`` after
its own replicate all-reduce and before the post-divide; the hook conforms when
the gradients stay bitwise equal to native HSDP with no hook.

Every check compares, after each of several SGD steps, the local shard of every
DTensor gradient (``p.grad.to_local()``), the full gradient
(``p.grad.full_tensor()``, collective, in the same order on every rank) and,
after the optimizer step, the local shard of every parameter, per FQN.

Checks (each registered with :func:`conformance.ranks.checks.rank_check`):

* ``fsdp2.parity``: a custom reduce-scatter comm against native ``fully_shard``,
  under a config (``CONFIGS``): plain, a gradient divide factor, forced SUM
  reductions, both, or HSDP;
* ``fsdp2.all_reduce_parity``: an all-reduce hook under native HSDP;
* the lossy-contract checks (``fsdp2.lossy_error``, ``fsdp2.lossy_loss``,
  ``fsdp2.lossy_determinism``) are ``conformance/ranks/checks/lossy.py``'s, driving the
  FSDP2 models of :func:`lossy_models`. A comm with ``lossy=LossyContract(...)``
  gets those instead of parity, hard inputs and clip_grad_norm_. An
  ``fsdp2_all_reduce`` hook cannot declare a contract (:func:`validate_all_reduce_hook`).

Only ``torch`` is imported at module level: everything FSDP2 is looked up when
a check runs, so this module imports on torch versions without FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.apis import CasePlan, HookApi, SuiteTest, called_as, no_strategies
from conformance.apis.fsdp2.build import (HSDP_REPLICATE, apply_config, build_fsdp2, fsdp_modules, hsdp_shape,
                                              mesh_for, missing_api)
from conformance.apis.fsdp2.recorders import CommRecorder, HookRecorder, make_comm
from conformance.cases import CaseParams
from conformance.ranks.checks import lossy, rank_check
from conformance.ranks.checks.common import (Lockstep, clip_grad_norm_parity, fqn_without_wrappers, lockstep,
                                       named_grads, named_params, train_alone, train_step)
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.probe import Example, run_examples
from conformance.ranks.compare import dtype_name
from conformance.apis.fsdp2.arithmetic import AllReduceHookArithmetic, CommArithmetic
from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.diagnosis import diagnose
from conformance.protocol import Finding
from conformance.spec import SpecError, binds_signature, qualname, signature_text

#: Configurations of the FSDP modules a comm is checked under.
#: ``default``: nothing set; ``divide_factor``: ``set_gradient_divide_factor``;
#: ``force_sum``: ``set_force_sum_reduction_for_comms(True)``;
#: ``divide_factor_force_sum``: both; ``hsdp``: a 2-D (replicate, shard) mesh; ``subgroup``: a
#: 1-D mesh over this rank's data-parallel subgroup (``conformance.ranks.checks.groups``), not WORLD.
CONFIGS = ("default", "divide_factor", "force_sum", "divide_factor_force_sum", "hsdp", "subgroup")

#: FSDPModule methods each config needs (besides ``set_custom_reduce_scatter``).
CONFIG_APIS: Dict[str, Tuple[str, ...]] = {
    "default": (),
    "divide_factor": ("set_gradient_divide_factor",),
    "force_sum": ("set_force_sum_reduction_for_comms",),
    "divide_factor_force_sum": ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"),
    "hsdp": (),
    "subgroup": (),
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
    return config == "divide_factor" and dtype in (torch.float32, torch.bfloat16)


# -- comparing -------------------------------------------------------------------------------


def _full_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``p.grad.full_tensor()`` per FQN: collective, so every rank walks the same parameters in order."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[fqn_without_wrappers(n)] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)
    return out



def _plan(ctx: Any, model_name: str, ref: nn.Module, hooked: nn.Module, recorder: Any, *, reference: str,
          context: Any, arithmetic: Arithmetic, inputs: Any = None,
          reduce_dtype: Optional[torch.dtype] = None) -> Lockstep:
    """Both models in lockstep: local and full gradients after each backward, local parameters after each
    optimizer step; ``inputs`` defaults to the model's own rank-dependent inputs. A failure is diagnosed
    from the recorder's calls against ``arithmetic`` (:mod:`conformance.ranks.diagnosis`); ``reduce_dtype`` is the
    spec's claim (gradient mismatches count their ULPs in it too)."""
    from conformance.models import get_model

    model_cls = get_model(model_name)

    def start_step(step: int) -> None:
        recorder.step = step

    return Lockstep(
        ref=ref, hooked=hooked, loss_fn=model_cls.loss, reference=reference,
        inputs=model_cls.make_input(ctx.rank, ctx.world_size, ctx.device) if inputs is None else inputs,
        grads=[("local gradient shard", named_grads, ""),
               ("full gradient", _full_grads, "full_tensor() of every gradient")],
        params=("local parameter shard after the optimizer step", named_params, ""),
        hook_findings=lambda step: recorder.findings(ctx.rank, step), start_step=start_step, context=context,
        diagnose=lambda step: diagnose(ctx, arithmetic, recorder.log, step),
        findings_so_far=lambda step: recorder.findings_so_far(ctx.rank, step), reduce_dtype=reduce_dtype)


# -- checks ----------------------------------------------------------------------------------


@rank_check("fsdp2.parity")
def parity(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 3, lr: float = 0.01,
           reference_only: bool = False) -> List[Finding]:
    """The comm under ``fully_shard`` is bitwise equal to native ``fully_shard`` every step."""
    if reference_only:
        from conformance.models import get_model

        ctx = on_subgroup(ctx) if config == "subgroup" else ctx
        ref, _ = _native(ctx, spec, config, model)
        model_cls = get_model(model)
        return train_alone(ctx, ref, torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9),
                           model_cls.make_input(ctx.rank, ctx.world_size, ctx.device), model_cls.loss, steps)
    if config == "subgroup":
        ctx = on_subgroup(ctx)
    return lockstep(ctx, _comm_plan(ctx, spec, config, model), steps=steps, lr=lr)


def _native(ctx: Any, spec: Any, config: str, model: str) -> Tuple[nn.Module, Any]:
    """The reference, ``model`` under native ``fully_shard`` in ``config``, and the config's mesh."""
    if config not in CONFIGS:
        raise ValueError(f"unknown FSDP2 config {config!r}; known: {', '.join(CONFIGS)}")
    shape = hsdp_shape(ctx.world_size) if config == "hsdp" else (ctx.world_size,)
    ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
    mesh = mesh_for(ctx, shape)
    ctx.phase("building the reference model (native reduce-scatter)")
    ref = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    apply_config(ref, config, ctx.world_size)
    return ref, mesh


def _comm_plan(ctx: Any, spec: Any, config: str, model: str, inputs: Any = None, label: Any = None) -> Lockstep:
    """The hooked model (the comm on every FSDP module, through a :class:`CommRecorder`) against native."""
    ref, mesh = _native(ctx, spec, config, model)
    ctx.phase("building the hooked model")
    hooked = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    apply_config(hooked, config, ctx.world_size)
    recorder = CommRecorder(make_comm(spec))
    for module in fsdp_modules(hooked):
        module.set_custom_reduce_scatter(recorder)

    def context(step: int) -> str:
        called = f"FSDP2 called the comm with {recorder.summary(step)}"
        return called if label is None else f"{label(step)}; {called}"

    reference = "native fully_shard" + ("" if spec.reduce_dtype is None else
                                        f" with reduce_dtype={dtype_name(spec.reduce_dtype)}")
    return _plan(ctx, model, ref, hooked, recorder, reference=reference, context=context, inputs=inputs,
                 arithmetic=CommArithmetic(ctx.world_size, spec.reduce_dtype), reduce_dtype=spec.reduce_dtype)


@rank_check("fsdp2.clip_grad_norm")
def clip_grad_norm(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 2, lr: float = 0.01,
                   reference_only: bool = False) -> List[Finding]:
    """``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients with the comm installed, for norm types 2
    and inf: the total norm (its ``full_tensor()``) and the clipped gradients bitwise equal to native."""
    from conformance.models import get_model

    def make_reference() -> Tuple[nn.Module, Any, Any]:
        model_cls = get_model(model)
        return _native(ctx, spec, config, model)[0], model_cls.make_input(ctx.rank, ctx.world_size,
                                                                          ctx.device), model_cls.loss

    return clip_grad_norm_parity(ctx, lambda: _comm_plan(ctx, spec, config, model), steps=steps, lr=lr,
                                 make_reference=make_reference if reference_only else None)


@rank_check("fsdp2_all_reduce.parity")
def all_reduce_parity(ctx: Any, spec: Any, *, model: str, config: str = "hsdp", steps: int = 3,
                      lr: float = 0.01) -> List[Finding]:
    """An all-reduce hook under native HSDP leaves every gradient bitwise as native HSDP without it."""
    return lockstep(ctx, _all_reduce_plan(ctx, spec, model), steps=steps, lr=lr)


def _all_reduce_plan(ctx: Any, spec: Any, model: str, inputs: Any = None, label: Any = None) -> Lockstep:
    """The hook on every FSDP module of a native HSDP model (through a :class:`HookRecorder`) against
    the same model without it."""
    shape = hsdp_shape(ctx.world_size)
    ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
    mesh = mesh_for(ctx, shape)
    ctx.phase("building the reference model (native HSDP, no hook)")
    ref = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    ctx.phase("building the hooked model")
    hooked = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    recorder = HookRecorder(spec.hook)
    for module in fsdp_modules(hooked):
        module.set_all_reduce_hook(recorder)

    def context(step: int) -> str:
        seen = sorted({dtype_name(c["dtype"]) for c in recorder.calls if c["step"] == step})
        got = f"the hook got the all-reduced {'/'.join(seen) or '?'} gradients of a {shape[0]}x{shape[1]} HSDP mesh"
        return got if label is None else f"{label(step)}; {got}"

    return _plan(ctx, model, ref, hooked, recorder, reference="native HSDP without the hook", context=context,
                 inputs=inputs, arithmetic=AllReduceHookArithmetic(ctx.world_size, None,
                                                                    divisors=(shape[0], shape[1], ctx.world_size)),
                 reduce_dtype=spec.reduce_dtype)


def _local_only(plan: Lockstep) -> Lockstep:
    """``plan`` for hard inputs: every rank's local gradient shard (together, every element), no
    ``full_tensor()`` all-gathers, no optimizer step."""
    return dataclasses.replace(plan, grads=plan.grads[:1], params=None)


@rank_check("fsdp2.hard_inputs")
def hard_inputs(ctx: Any, spec: Any, *, config: str, examples: Sequence[Example], case_id: str,
                fresh: bool = True, model: str = "gradient_probe") -> List[Finding]:
    """Chosen gradients through the probe (:func:`conformance.ranks.checks.probe.run_examples`), bitwise vs native
    ``fully_shard``, the comm installed."""
    def make_plan(inputs: Any, context: Any) -> Lockstep:
        return _local_only(_comm_plan(ctx, spec, config, "gradient_probe", inputs, context))

    return run_examples(ctx, case_id, examples, fresh, make_plan)


@rank_check("fsdp2_all_reduce.hard_inputs")
def all_reduce_hard_inputs(ctx: Any, spec: Any, *, examples: Sequence[Example], case_id: str, fresh: bool = True,
                           config: str = "hsdp", model: str = "gradient_probe") -> List[Finding]:
    """Chosen gradients through the probe under native HSDP, the all-reduce hook installed, bitwise vs
    native HSDP without it."""
    def make_plan(inputs: Any, context: Any) -> Lockstep:
        return _local_only(_all_reduce_plan(ctx, spec, "gradient_probe", inputs, context))

    return run_examples(ctx, case_id, examples, fresh, make_plan)


# -- lossy contracts ----------------------------------------------------------------------


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``p.full_tensor()`` per FQN (collective, in the same order on every rank)."""
    with torch.no_grad():
        return {fqn_without_wrappers(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for n, p in model.named_parameters()}


def lossy_models(ctx: Any, spec: Any, *, config: str, model: str) -> lossy.LossyModels:
    """The FSDP2 models of the lossy-contract checks (:class:`conformance.ranks.checks.lossy.LossyModels`) in
    ``config`` (``default``, ``force_sum`` or ``hsdp``: the configs whose native reference gloo runs).

    The comm is installed on every FSDP module of a model under
    ``MixedPrecisionPolicy(reduce_dtype=spec.reduce_dtype)`` (the dtype of the buffers FSDP2 hands it),
    through a :class:`CommRecorder` whose findings (``allocate``'s buffer, never called) join the lossy
    error's. Gradients are compared as full tensors (``DTensor.full_tensor()``): the contract bounds each
    parameter's relative error, which a shard's is not. The loss reference is native ``fully_shard`` in
    full precision (no custom comm, no reduce dtype).
    """
    from conformance.models import get_model

    if config not in ("default", "force_sum", "hsdp"):
        raise ValueError(f"the lossy checks run FSDP2 configs default, force_sum and hsdp, not {config!r}")
    model_cls = get_model(model)
    shape = hsdp_shape(ctx.world_size) if config == "hsdp" else (ctx.world_size,)
    ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
    mesh = mesh_for(ctx, shape)

    def build(reduce_dtype: Optional[torch.dtype]) -> nn.Module:
        built = build_fsdp2(model, ctx, mesh, reduce_dtype=reduce_dtype)
        apply_config(built, config, ctx.world_size)
        return built

    def hooked_model() -> lossy.HookedModel:
        hooked = build(spec.reduce_dtype)
        recorder = CommRecorder(make_comm(spec))
        for module in fsdp_modules(hooked):
            module.set_custom_reduce_scatter(recorder)

        def run_step(step: int, run: Any) -> None:
            recorder.step = step
            run()

        return lossy.HookedModel(hooked, run_step, lambda step: recorder.findings(ctx.rank, step))

    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    return lossy.LossyModels(
        model_cls=model_cls, build_hooked=hooked_model, build_native=lambda: build(None), inputs=inputs,
        micro_inputs=[inputs], train=train_step, full_grads=_full_grads, full_params=_full_params)


lossy.register("fsdp2", lossy_models)


# -- the API: validation and case plans ------------------------------------------------

#: ``(config, model)`` pairs per world-size role and claim. The full-precision claim runs
#: every reference model at the main world size; a reduced-precision claim (its comm sees
#: the same ops on bfloat16/float16 buffers) runs fewer. The divide-factor and forced-SUM
#: configs run on one model: they change the op FSDP2 passes, not the model.
FACTOR_CONFIGS = ("divide_factor", "force_sum", "divide_factor_force_sum")
PLAN: Dict[Tuple[str, str], Tuple[Tuple[str, str], ...]] = {
    ("main", "full"): tuple(("default", m) for m in ("net_wrapped", "nested_wrapped", "always_wrap_nested",
                                                     "gradient_probe", "mixture_of_experts"))
    + tuple((c, "nested_wrapped") for c in FACTOR_CONFIGS),
    ("extra", "full"): (("default", "nested_wrapped"), ("default", "gradient_probe"),
                        ("divide_factor", "nested_wrapped"), ("divide_factor_force_sum", "nested_wrapped"),
                        ("force_sum", "gradient_probe")),
    ("main", "low"): (("default", "nested_wrapped"), ("divide_factor", "nested_wrapped"),
                      ("divide_factor_force_sum", "nested_wrapped")),
    ("extra", "low"): (("default", "nested_wrapped"),),
    ("hsdp", "full"): (("hsdp", "nested_wrapped"), ("subgroup", "nested_wrapped")),
    ("hsdp", "low"): (("hsdp", "nested_wrapped"), ("subgroup", "nested_wrapped")),
}
#: Hard inputs through the probe, per world-size role, in the default config: the op FSDP2
#: passes for the claim (AVG for float32/bfloat16; for float16, SUM with FSDP2's own pre- and
#: post-divide, where an undivided sum overflows first). Not under HSDP or the other configs:
#: the comm sees the same ops there, and the default run's 60 s budget is better spent at 2
#: and 3 ranks (an all-reduce hook's hard inputs run under HSDP, its only setting).
HARD_INPUT_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "main": (("default", "gradient_probe"),),
    "extra": (("default", "gradient_probe"),),
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
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy (first world size).
LOSSY_LOSS_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("default", "transformer_shared"),)}
#: Two runs from the same seed (first world size).
LOSSY_DETERMINISM_PLAN: Dict[str, Tuple[Tuple[str, str], ...]] = {"main": (("default", "nested_wrapped"),)}
#: Models an all-reduce hook runs under native HSDP.
ALL_REDUCE_MODELS = ("nested_wrapped",)
#: The smallest HSDP world size: a HSDP_REPLICATE x 2 (replicate x shard) mesh.
HSDP_WORLD_SIZE = 2 * HSDP_REPLICATE
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


def skip_reason(case: CaseParams, spec: Any, settings: Any) -> Optional[str]:
    """Why ``case`` cannot run here, after its world size's availability (``None``: it runs)."""
    if case.variant in ("hsdp", "subgroup"):
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
    if settings.backend == "gloo" and uses_premul_sum(case.variant, spec.reduce_dtype):
        return GLOO_PREMUL_SUM
    return None


def _with_skips(cases: List[CaseParams], specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    from conformance.models import MODELS

    by_name = {spec.name: spec for spec in specs}
    return [dataclasses.replace(c, skip=skip_reason(c, by_name[c.hook], settings)) for c in cases if c.model in MODELS]


def _exact(spec: Any) -> bool:
    return spec.lossy is None


def parity_cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """The comm cases of a run: per spec that claims exactness, :data:`PLAN` at each world size by its
    role, then HSDP."""
    out = []
    for spec in filter(_exact, specs):
        claim = "full" if spec.reduce_dtype is None else "low"
        roles = [(settings.role(ws), ws) for ws in settings.world_sizes]
        roles.append(("hsdp", hsdp_world_size(settings.world_sizes)))
        for role, ws in roles:
            out.extend(test.case(spec.name, config, ws, model=model) for config, model in PLAN[(role, claim)])
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


def lossy_plan(plan: Dict[str, Tuple[Tuple[str, str], ...]], keep: Any, *, first_only: bool = False) -> CasePlan:
    """A case plan of a lossy-contract check: per kept spec, ``plan[role]`` at each world size by its role
    (only the run's first with ``first_only``), then ``plan["hsdp"]`` at the HSDP world size."""
    def cases(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        out = []
        for spec in filter(keep, specs):
            sizes = settings.world_sizes[:1] if first_only else settings.world_sizes
            roles = [(settings.role(ws), ws) for ws in sizes] + [("hsdp", hsdp_world_size(settings.world_sizes))]
            for role, ws in roles:
                out.extend(test.case(spec.name, config, ws, model=model) for config, model in plan.get(role, ()))
        return _with_skips(out, specs, settings)

    return cases


def all_reduce_cases(test: SuiteTest, specs: Sequence[Any], settings: Any, models: Sequence[str] = ALL_REDUCE_MODELS
                     ) -> List[CaseParams]:
    """An all-reduce hook's cases: each of ``models`` under HSDP."""
    ws = hsdp_world_size(settings.world_sizes)
    return _with_skips([test.case(spec.name, "hsdp", ws, model=model) for spec in specs for model in models],
                       specs, settings)


#: A suite test of each API: ``_comm_test(check, rank_check, plan, kind=..., params=...)``.
_comm_test = functools.partial(SuiteTest, "fsdp2", "config")
_all_reduce_test = functools.partial(SuiteTest, "fsdp2_all_reduce", "config")

APIS = (
    HookApi(name="fsdp2", installed_with="FSDPModule.set_custom_reduce_scatter(comm)", variant_field="config",
            stateful=False, validate=validate, builtin_hooks="conformance.apis.fsdp2.builtin_hooks:FSDP2_HOOKS",
            default_hook="conformance.apis.fsdp2.builtin_hooks:default_hook",
            plans={"test_fsdp2_parity": _comm_test("fsdp2_parity", "parity", parity_cases, kind="exact"),
                   "test_fsdp2_hard_inputs": _comm_test("fsdp2_hard_inputs", "hard_inputs", hard_input_cases,
                                                        kind="hard_inputs"),
                   "test_fsdp2_clip_grad_norm": _comm_test("fsdp2_clip_grad_norm", "clip_grad_norm", clip_cases),
                   "test_fsdp2_lossy_error": _comm_test("fsdp2_lossy_error", "lossy_error", lossy_plan(
                       LOSSY_ERROR_PLAN, lambda spec: not _exact(spec)), kind="lossy_error"),
                   "test_fsdp2_lossy_loss": _comm_test("fsdp2_lossy_loss", "lossy_loss", lossy_plan(
                       LOSSY_LOSS_PLAN, lambda spec: spec.lossy is not None and spec.lossy.loss_margin is not None,
                       first_only=True), kind="lossy_loss"),
                   "test_fsdp2_lossy_determinism": _comm_test("fsdp2_lossy_determinism", "lossy_determinism", lossy_plan(
                       LOSSY_DETERMINISM_PLAN, lambda spec: spec.lossy is not None and spec.lossy.deterministic,
                       first_only=True), kind="lossy_determinism")}),
    HookApi(name="fsdp2_all_reduce", installed_with="FSDPModule.set_all_reduce_hook(hook) (HSDP)",
            variant_field="config", stateful=False,
            validate=validate_all_reduce_hook, builtin_hooks=None,
            plans={"test_fsdp2_all_reduce_hook": _all_reduce_test("fsdp2_all_reduce_hook", "parity", all_reduce_cases),
                   "test_fsdp2_all_reduce_hard_inputs": _all_reduce_test(
                       "fsdp2_all_reduce_hard_inputs", "hard_inputs",
                       functools.partial(all_reduce_cases, models=("gradient_probe",)), kind="hard_inputs")}),
)
