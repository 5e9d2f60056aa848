"""Rank-side checks for FSDP2 (``fully_shard``): custom reduce-scatter comms and all-reduce hooks.

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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.checks import rank_check
from conformance.checks.common import Lockstep, fqn_without_wrappers, lockstep, named_grads, named_params, train_alone
from conformance.compare import dtype_name
from conformance.protocol import Finding

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

#: Size of the replicate dimension of the HSDP mesh; the shard dimension takes the rest.
HSDP_REPLICATE = 2


def divide_factor(world_size: int) -> float:
    """The factor the ``divide_factor`` configs set: twice the data-parallel size.

    Realistic (a loss summed over two micro-batches) and it keeps FSDP2's
    float16 split non-trivial: pre-divide 2 and post-divide 2 at 2 ranks,
    2 and 3 at 3 ranks.
    """
    return 2.0 * world_size


# -- torch capabilities (controller and ranks) --------------------------------------------


def fsdp2_api() -> Optional[Tuple[Any, Any, Any]]:
    """``(fully_shard, MixedPrecisionPolicy, FSDPModule)``, or ``None`` on a torch without FSDP2.

    ``torch.distributed.fsdp`` exports them from torch 2.6; 2.4 and 2.5 have
    them under ``torch.distributed._composable.fsdp``.
    """
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(where, fromlist=["fully_shard"])
            return module.fully_shard, module.MixedPrecisionPolicy, module.FSDPModule
        except (ImportError, AttributeError):
            continue
    return None


def missing_api(methods: Sequence[str] = ()) -> Optional[str]:
    """Why this torch cannot run an FSDP2 check needing ``FSDPModule.<methods>``, or ``None``."""
    version = torch.__version__
    if not dist.is_available():
        return f"torch {version} was built without torch.distributed"
    api = fsdp2_api()
    if api is None:
        return f"torch {version} has no FSDP2 fully_shard (torch.distributed.fsdp.fully_shard)"
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    except ImportError:
        return f"torch {version} has no torch.distributed.device_mesh.init_device_mesh"
    missing = [m for m in methods if not hasattr(api[2], m)]
    if missing:
        return f"torch {version} has no FSDPModule.{', FSDPModule.'.join(missing)} (FSDP2 API added in a later torch)"
    return None


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


# -- meshes ----------------------------------------------------------------------------------

_MESHES: Dict[Tuple[Any, ...], Any] = {}


def mesh_for(ctx: Any, shape: Tuple[int, ...]) -> Any:
    """A device mesh of ``shape`` over the pool's ranks, cached per process group and shape.

    A 1-D mesh over the whole pool reuses the default process group (no new
    group); a 2-D mesh creates one sub-group per row and column, which is
    collective over the default group and costly, so it is built once per
    pool. Every rank asks for the same meshes in the same order (cases run in
    lockstep), so the collective creation matches up.
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(ctx.group), ctx.world_size, ctx.device.type, tuple(shape))
    if key not in _MESHES:
        if len(shape) == 1:
            _MESHES[key] = init_device_mesh(ctx.device.type, tuple(shape))
        else:
            _MESHES[key] = init_device_mesh(ctx.device.type, tuple(shape), mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def hsdp_shape(world_size: int) -> Tuple[int, int]:
    if world_size % HSDP_REPLICATE or world_size < 2 * HSDP_REPLICATE:
        raise ValueError(f"HSDP needs a world size that is a multiple of {HSDP_REPLICATE} and at least "
                         f"{2 * HSDP_REPLICATE}, got {world_size}")
    return (HSDP_REPLICATE, world_size // HSDP_REPLICATE)


# -- models ----------------------------------------------------------------------------------


def _unit_modules(model: nn.Module) -> List[nn.Module]:
    """The submodules that get their own ``fully_shard``, innermost first (root excluded).

    The same units as the model's FSDP1 build: the submodules its
    ``_wrap_nested`` wraps, plus those its root ``auto_wrap_policy`` would wrap
    (``always_wrap_policy``: every submodule holding parameters;
    ``ModuleWrapPolicy``: instances of its classes).
    """
    units: List[nn.Module] = []

    def record(module: nn.Module) -> nn.Module:
        units.append(module)
        return module

    model._wrap_nested(record)
    policy = type(model)._root_fsdp_kwargs({}).get("auto_wrap_policy")
    if policy is not None:
        classes = getattr(policy, "_module_classes", None)
        for module in _post_order(model):
            if module is model or any(module is u for u in units):
                continue
            if classes is None:
                if any(True for _ in module.parameters()):
                    units.append(module)
            elif isinstance(module, tuple(classes)):
                units.append(module)
    return units


def _post_order(module: nn.Module) -> List[nn.Module]:
    out: List[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def build_fsdp2(model_name: str, ctx: Any, mesh: Any, *, reduce_dtype: Optional[torch.dtype]) -> nn.Module:
    """The reference model under ``fully_shard``: one call per FSDP1 unit, innermost first, then the root.

    ``mesh`` is the data-parallel mesh (1-D, or 2-D for HSDP).
    ``mixture_of_experts`` shards its expert over a 1-rank mesh of its own
    (``MixtureOfExperts.apply_fully_shard``).
    """
    from conformance.models import get_model

    fully_shard, MixedPrecisionPolicy, _ = fsdp2_api()
    cls = get_model(model_name)
    model = cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    kwargs: Dict[str, Any] = {}
    if reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    if hasattr(cls, "apply_fully_shard"):
        if mesh.ndim != 1:
            raise ValueError(f"{model_name} builds its own 1-D meshes; it cannot run under HSDP")
        return cls.apply_fully_shard(model, group=ctx.group, device=ctx.device, **kwargs)
    for unit in _unit_modules(model):
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def fsdp_modules(model: nn.Module) -> List[nn.Module]:
    """Every FSDP2 module of ``model`` (root included); settings are per module in FSDP2."""
    _, _, FSDPModule = fsdp2_api()
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def apply_config(model: nn.Module, config: str, world_size: int) -> None:
    """Set the config's divide factor / forced SUM on every FSDP module (neither recurses)."""
    for module in fsdp_modules(model):
        if config in ("divide_factor", "divide_factor_force_sum"):
            module.set_gradient_divide_factor(divide_factor(world_size))
        if config in ("force_sum", "divide_factor_force_sum"):
            module.set_force_sum_reduction_for_comms(True)


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
