"""Building FSDP2 models and device meshes, and what this torch's FSDP2 can do (an FSDP2 extra).

The reference and the hooked model of every ``fsdp2`` / ``fsdp2_all_reduce``
case are built here, alike: ``fully_shard`` on the same units as the model's
FSDP1 build, innermost first, on a 1-D mesh (or a 2-D replicate x shard mesh
for HSDP), with ``MixedPrecisionPolicy(reduce_dtype=...)`` for a reduced-precision
claim; then a config's divide factor or forced SUM on every FSDP module.

Only ``torch`` is imported at module level: everything FSDP2 is looked up when
it is used, so this module imports on torch versions without FSDP2
(:func:`missing_api` says what is missing, as a skip reason).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.models import get_model

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
    try:  # an optional import: the answer to whether this torch has it
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401 - optional: probed, not used
    except ImportError:
        return f"torch {version} has no torch.distributed.device_mesh.init_device_mesh"
    missing = [m for m in methods if not hasattr(api[2], m)]
    if missing:
        return f"torch {version} has no FSDPModule.{', FSDPModule.'.join(missing)} (FSDP2 API added in a later torch)"
    return None


# -- meshes ----------------------------------------------------------------------------------

_MESHES: Dict[Tuple[Any, ...], Any] = {}


def mesh_for(ctx: Any, shape: Tuple[int, ...]) -> Any:
    """A device mesh of ``shape`` over the pool's ranks, cached per process group and shape.

    A 1-D mesh over the whole pool reuses the default process group (no new
    group), one over a subgroup (``ctx.group`` is not WORLD) wraps it; a 2-D mesh creates one sub-group per row and column, which is
    collective over the default group and costly, so it is built once per
    pool. Every rank asks for the same meshes in the same order (cases run in
    lockstep), so the collective creation matches up.
    """
    # Looked up here, not at import: the plan imports this module on torch versions without FSDP2 (missing_api).
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # optional: see above

    key = (id(ctx.group), ctx.world_size, ctx.device.type, tuple(shape))
    if key not in _MESHES:
        if ctx.group is not dist.group.WORLD:  # a subgroup (conformance.ranks.checks.groups): a 1-D mesh over it
            if len(shape) != 1:
                raise ValueError(f"a mesh over a subgroup is 1-D, not {shape}")
            _MESHES[key] = DeviceMesh.from_group(ctx.group, ctx.device.type)
        elif len(shape) == 1:
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


def _plain_model(model_name: str, ctx: Any,
                 reduce_dtype: Optional[torch.dtype]) -> Tuple[Any, nn.Module, Dict[str, Any]]:
    """``(model class, the plain model on ctx's device, the FSDP2 keyword arguments of the claim)``: with
    ``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)`` for a reduced-precision claim."""
    _, MixedPrecisionPolicy, _ = fsdp2_api()
    cls = get_model(model_name)
    model = cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    kwargs: Dict[str, Any] = {}
    if reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return cls, model, kwargs


def _wrap_units(model: nn.Module, wrap: Callable[[nn.Module], Any]) -> nn.Module:
    """``wrap`` (``fully_shard``, ``replicate``) on every FSDP1 unit of ``model``, innermost first, then the root."""
    for unit in _unit_modules(model):
        wrap(unit)
    wrap(model)
    return model


def build_fsdp2(model_name: str, ctx: Any, mesh: Any, *, reduce_dtype: Optional[torch.dtype]) -> nn.Module:
    """The reference model under ``fully_shard``: one call per FSDP1 unit, innermost first, then the root.

    ``mesh`` is the data-parallel mesh (1-D, or 2-D for HSDP).
    ``mixture_of_experts`` shards its expert over a 1-rank mesh of its own
    (``MixtureOfExperts.apply_fully_shard``).
    """
    fully_shard = fsdp2_api()[0]
    cls, model, kwargs = _plain_model(model_name, ctx, reduce_dtype)
    if hasattr(cls, "apply_fully_shard"):
        if mesh.ndim != 1:
            raise ValueError(f"{model_name} builds its own 1-D meshes; it cannot run under HSDP")
        return cls.apply_fully_shard(model, group=ctx.group, device=ctx.device, **kwargs)
    return _wrap_units(model, lambda module: fully_shard(module, mesh=mesh, **kwargs))


def replicate_api() -> Optional[Any]:
    """``replicate`` built on FSDP2 (``torch.distributed._composable.replicate_with_fsdp.replicate``), or
    ``None`` on a torch without it (a private module PyTorch may move; torchtitan's data parallelism)."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # optional: probed
    except ImportError:
        return None
    return replicate


def missing_replicate() -> Optional[str]:
    """Why this torch cannot run ``replicate`` on FSDP2, or ``None``."""
    if replicate_api() is None:
        return (f"torch {torch.__version__} has no torch.distributed._composable.replicate_with_fsdp.replicate "
                "(replicate built on FSDP2)")
    return None


def build_replicate(model_name: str, ctx: Any, *, reduce_dtype: Optional[torch.dtype],
                    divide_factor: Optional[float] = None) -> nn.Module:
    """The reference model under ``replicate`` (on FSDP2): one call per FSDP1 unit, innermost first, then the
    root, over the default 1-D ``("replicate",)`` mesh of the pool; ``set_gradient_divide_factor(divide_factor)``
    on every module where given (``1.0``: a SUM, torchtitan's default)."""
    replicate = replicate_api()
    _, model, kwargs = _plain_model(model_name, ctx, reduce_dtype)
    _wrap_units(model, lambda module: replicate(module, **kwargs))
    if divide_factor is not None:
        for module in fsdp_modules(model):
            module.set_gradient_divide_factor(divide_factor)
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
