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

Checks (each registered with :func:`conformance.checks.rank_check`):

* ``fsdp2.parity``: a custom reduce-scatter comm against native ``fully_shard``,
  under a config (``CONFIGS``): plain, a gradient divide factor, forced SUM
  reductions, both, or HSDP;
* ``fsdp2.all_reduce_parity``: an all-reduce hook under native HSDP.

Only ``torch`` is imported at module level: everything FSDP2 is looked up when
a check runs, so this module imports on torch versions without FSDP2.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.adapters import HookApi, called_as, no_strategies
from conformance.adapters.fsdp2_build import (HSDP_REPLICATE, apply_config, build_fsdp2, fsdp_modules, hsdp_shape,
                                              mesh_for, missing_api)
from conformance.cases import CaseParams
from conformance.checks import rank_check
from conformance.checks.common import Lockstep, fqn_without_wrappers, lockstep, named_grads, named_params, train_alone
from conformance.compare import dtype_name
from conformance.protocol import Finding
from conformance.spec import SpecError, binds_signature, qualname, signature_text

#: Configurations of the FSDP modules a comm is checked under.
#: ``default``: nothing set; ``divide_factor``: ``set_gradient_divide_factor``;
#: ``force_sum``: ``set_force_sum_reduction_for_comms(True)``;
#: ``divide_factor_force_sum``: both; ``hsdp``: a 2-D (replicate, shard) mesh.
CONFIGS = ("default", "divide_factor", "force_sum", "divide_factor_force_sum", "hsdp")

#: FSDPModule methods each config needs (besides ``set_custom_reduce_scatter``).
CONFIG_APIS: Dict[str, Tuple[str, ...]] = {
    "default": (),
    "divide_factor": ("set_gradient_divide_factor",),
    "force_sum": ("set_force_sum_reduction_for_comms",),
    "divide_factor_force_sum": ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"),
    "hsdp": (),
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


# -- recording what FSDP2 hands the comm -------------------------------------------------------


def op_name(op: Any) -> str:
    """``AVG``, ``SUM``, ``PREMUL_SUM(0.25)``, ... for a ``ReduceOp`` or ``RedOpType``."""
    inner = getattr(op, "op", None)
    if inner is not None:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        name = str(inner).split(".")[-1]
        return f"{name}({factor!r})" if factor is not None else name
    return str(op).split(".")[-1]


class CommRecorder:
    """Wraps the comm under test; forwards FSDP2's calls unchanged and records them.

    ``allocate`` and ``__call__`` are forwarded with exactly the arguments FSDP2
    passed (FSDP2 calls the comm with keywords ``output_tensor``,
    ``input_tensor``, ``group``, ``op``), so a comm whose parameter names differ
    fails here as it would in training. ``allocate`` results are checked against
    the request: FSDP2 views them as ``(world_size, -1)`` and writes the cast
    gradients into them, so a wrong size, dtype or device changes the result.
    """

    def __init__(self, comm: Any):
        self.comm = comm
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.bad_allocations: List[Dict[str, Any]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = self.comm.allocate(size, dtype=dtype, device=device)
        want = torch.Size([int(s) for s in size])
        if not isinstance(out, torch.Tensor):
            self.bad_allocations.append({"step": self.step, "size": tuple(want), "dtype": dtype,
                                         "got": f"a {type(out).__name__}, not a tensor"})
        elif out.shape != want or out.dtype != dtype or out.device.type != torch.device(device).type:
            self.bad_allocations.append({"step": self.step, "size": tuple(want), "dtype": dtype,
                                         "got": f"shape {tuple(out.shape)}, {dtype_name(out.dtype)} on {out.device}"})
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        op = kwargs.get("op", args[3] if len(args) > 3 else None)
        inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        self.calls.append({
            "step": self.step,
            "op": op_name(op),
            "group_size": None if group is None else group.size(),
            "dtype": None if inp is None else inp.dtype,
        })
        return self.comm(*args, **kwargs)

    def summary(self, step: int) -> str:
        seen = sorted({(c["op"], c["group_size"], dtype_name(c["dtype"])) for c in self.calls if c["step"] == step})
        return "; ".join(f"op={o} over a group of {g} in {d}" for o, g, d in seen) or "not called"

    def findings(self, rank: int, step: int) -> List[Finding]:
        out = []
        for bad in self.bad_allocations:
            if bad["step"] == step:
                out.append(Finding(rank, f"comm.allocate(size={bad['size']}, dtype={dtype_name(bad['dtype'])}) "
                                         f"returned {bad['got']}: FSDP2 writes the reduce-dtype gradients into "
                                         "exactly that buffer", step=step))
                break
        if not any(c["step"] == step for c in self.calls):
            out.append(Finding(rank, "FSDP2 never called the comm in this step (set_custom_reduce_scatter did "
                                     "not take effect)", step=step))
        return out


class HookRecorder:
    """Wraps an all-reduce hook; records each call's dtype and size."""

    def __init__(self, hook: Any):
        self.hook = hook
        self.step = 0
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, tensor: torch.Tensor) -> Any:
        self.calls.append({"step": self.step, "dtype": tensor.dtype, "numel": tensor.numel()})
        return self.hook(tensor)

    def findings(self, rank: int, step: int) -> List[Finding]:
        if not any(c["step"] == step for c in self.calls):
            return [Finding(rank, "FSDP2 never called the all-reduce hook in this step", step=step)]
        return []


def make_comm(spec: Any) -> Any:
    """The spec's comm: the object itself, or what its zero-argument factory returns."""
    hook = spec.hook
    if not isinstance(hook, type) and callable(getattr(hook, "allocate", None)):
        return hook
    comm = hook()  # a factory; a comm class is one too
    if not callable(getattr(comm, "allocate", None)) or not callable(comm):
        raise TypeError(f"the factory of hook {spec.name!r} returned {comm!r}, not a ReduceScatter comm "
                        "(an object with allocate() and __call__(output_tensor, input_tensor, group, op, async_op))")
    return comm


# -- comparing -------------------------------------------------------------------------------


def _full_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``p.grad.full_tensor()`` per FQN: collective, so every rank walks the same parameters in order."""
    out: Dict[str, Optional[torch.Tensor]] = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[fqn_without_wrappers(n)] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)
    return out



def _lockstep(ctx: Any, model_name: str, ref: nn.Module, hooked: nn.Module, recorder: Any, *,
              steps: int, lr: float, reference: str, context: Any) -> List[Finding]:
    """Train both models in lockstep; compare local/full gradients and local parameters every step."""
    from conformance.models import get_model

    model_cls = get_model(model_name)

    def start_step(step: int) -> None:
        recorder.step = step

    return lockstep(ctx, Lockstep(
        ref=ref, hooked=hooked, inputs=model_cls.make_input(ctx.rank, ctx.world_size, ctx.device),
        loss_fn=model_cls.loss, reference=reference,
        grads=[("local gradient shard", named_grads, ""),
               ("full gradient", _full_grads, "full_tensor() of every gradient")],
        params=("local parameter shard after the optimizer step", named_params, ""),
        hook_findings=lambda step: recorder.findings(ctx.rank, step), start_step=start_step, context=context),
        steps=steps, lr=lr)


# -- checks ----------------------------------------------------------------------------------


@rank_check("fsdp2.parity")
def parity(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 3, lr: float = 0.01,
           reference_only: bool = False) -> List[Finding]:
    """The comm under ``fully_shard`` is bitwise equal to native ``fully_shard`` every step."""
    if config not in CONFIGS:
        raise ValueError(f"unknown FSDP2 config {config!r}; known: {', '.join(CONFIGS)}")
    shape = hsdp_shape(ctx.world_size) if config == "hsdp" else (ctx.world_size,)
    ctx.phase(f"building the {'x'.join(map(str, shape))} device mesh")
    mesh = mesh_for(ctx, shape)
    ctx.phase("building the reference model (native reduce-scatter)")
    ref = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    apply_config(ref, config, ctx.world_size)
    if reference_only:
        from conformance.models import get_model

        model_cls = get_model(model)
        return train_alone(ctx, ref, torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9),
                           model_cls.make_input(ctx.rank, ctx.world_size, ctx.device), model_cls.loss, steps)
    ctx.phase("building the hooked model")
    hooked = build_fsdp2(model, ctx, mesh, reduce_dtype=spec.reduce_dtype)
    apply_config(hooked, config, ctx.world_size)
    recorder = CommRecorder(make_comm(spec))
    for module in fsdp_modules(hooked):
        module.set_custom_reduce_scatter(recorder)

    def context(step: int) -> str:
        return f"FSDP2 called the comm with {recorder.summary(step)}"

    reference = "native fully_shard" + ("" if spec.reduce_dtype is None else
                                        f" with reduce_dtype={dtype_name(spec.reduce_dtype)}")
    return _lockstep(ctx, model, ref, hooked, recorder, steps=steps, lr=lr, reference=reference,
                              context=context)


@rank_check("fsdp2.all_reduce_parity")
def all_reduce_parity(ctx: Any, spec: Any, *, model: str, steps: int = 3, lr: float = 0.01) -> List[Finding]:
    """An all-reduce hook under native HSDP leaves every gradient bitwise as native HSDP without it."""
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
        return f"the hook got the all-reduced {'/'.join(seen) or '?'} gradients of a {shape[0]}x{shape[1]} HSDP mesh"

    return _lockstep(ctx, model, ref, hooked, recorder, steps=steps, lr=lr,
                              reference="native HSDP without the hook", context=context)


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
                        ("divide_factor", "nested_wrapped"), ("divide_factor_force_sum", "nested_wrapped")),
    ("main", "low"): (("default", "nested_wrapped"), ("divide_factor", "nested_wrapped"),
                      ("divide_factor_force_sum", "nested_wrapped")),
    ("extra", "low"): (("default", "nested_wrapped"),),
    ("hsdp", "full"): (("hsdp", "nested_wrapped"),),
    ("hsdp", "low"): (("hsdp", "nested_wrapped"),),
}
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
    if case.variant == "hsdp":
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


def parity_cases(specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """The comm cases of a run: per spec, :data:`PLAN` at each world size by its role, then HSDP."""
    out = []
    for spec in specs:
        claim = "full" if spec.reduce_dtype is None else "low"
        roles = [(settings.role(ws), ws) for ws in settings.world_sizes]
        roles.append(("hsdp", hsdp_world_size(settings.world_sizes)))
        for role, ws in roles:
            out.extend(CaseParams(spec.name, config, ws, model=model, api=spec.api)
                       for config, model in PLAN[(role, claim)])
    return _with_skips(out, specs, settings)


def all_reduce_cases(specs: Sequence[Any], settings: Any) -> List[CaseParams]:
    """An all-reduce hook's cases: each of :data:`ALL_REDUCE_MODELS` under HSDP."""
    ws = hsdp_world_size(settings.world_sizes)
    return _with_skips([CaseParams(spec.name, "hsdp", ws, model=model, api=spec.api)
                        for spec in specs for model in ALL_REDUCE_MODELS], specs, settings)


APIS = (
    HookApi(name="fsdp2", installed_with="FSDPModule.set_custom_reduce_scatter(comm)", variant_field="config",
            stateful=False, validate=validate, builtin_hooks="conformance.builtin_hooks.fsdp2:FSDP2_HOOKS",
            plans={"test_fsdp2_parity": parity_cases}),
    HookApi(name="fsdp2_all_reduce", installed_with="FSDPModule.set_all_reduce_hook(hook) (HSDP)",
            variant_field="config", stateful=False,
            validate=called_as(1, "an FSDP2 all-reduce hook is called as hook(tensor)"), builtin_hooks=None,
            plans={"test_fsdp2_all_reduce_hook": all_reduce_cases}),
)
