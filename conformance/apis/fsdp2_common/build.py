"""Building FSDP2 models and device meshes on the ranks, and what this torch's FSDP2 can do.

The reference and the hooked model of every FSDP2 case are built here, alike,
as the API's setup object says (:func:`build_model`, over
:func:`~conformance.apis.fsdp2_common.standalone.wrap_model`, which reproducers
copy): ``fully_shard`` on the same units as the model's FSDP1 build, innermost
first, on the config's mesh (or ``replicate`` on FSDP2), with
``MixedPrecisionPolicy(reduce_dtype=...)`` for a reduced-precision claim; then
a config's divide factor or forced SUM on every FSDP module. Also the model of
several parameter groups the registration rules need
(:func:`several_groups_model`).

It imports FSDP2 (through the standalone part), and still imports on torch versions without it, where
those names are ``None`` (:func:`missing_api` says what is missing, as a skip reason). The plans import
it when they plan a case, so a run that plans no FSDP2 case does not load FSDP2 in the controller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

# The unit walk and the builds live in the FSDP2 standalone part, of which reproducers copy what a case runs (torch only).
from conformance.apis.fsdp2_common.setup import Fsdp2Config
from conformance.apis.fsdp2_common.standalone import fsdp2_api, mixed_precision, replicate_api, wrap_model
from conformance.models import get_model

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from conformance.ranks.checks.groups import CheckContext

# -- torch capabilities (controller and ranks) --------------------------------------------


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


def mesh_for(ctx: CheckContext, shape: Tuple[int, ...]) -> DeviceMesh:
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


# -- models ----------------------------------------------------------------------------------


def build_fsdp2(model_name: str, ctx: CheckContext, mesh: DeviceMesh, *,
                reduce_dtype: Optional[torch.dtype]) -> nn.Module:
    """The reference model under ``fully_shard`` on ``mesh`` (1-D, or 2-D for HSDP), as
    :func:`~conformance.apis.fsdp2_common.standalone.wrap_model` builds it with no config of its own: one call per
    FSDP1 unit, innermost first, then the root.

    Raises:
        ValueError: a model that builds its own meshes (``mixture_of_experts``) on a 2-D mesh.
    """
    cls = get_model(model_name)
    return wrap_model(PLAIN_FULLY_SHARD, cls, cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None), mesh,
                      reduce_dtype, ctx.group, ctx.device, ctx.world_size, hooked=False)


#: The config of a plain ``fully_shard`` (:func:`build_fsdp2`): nothing set beyond the mesh.
PLAIN_FULLY_SHARD = Fsdp2Config("native fully_shard")


def build_model(ctx: CheckContext, layout: Fsdp2Config, model_name: str, mesh: DeviceMesh, *,
                reduce_dtype: Optional[torch.dtype], hooked: bool) -> nn.Module:
    """The reference (or, ``hooked``, the hooked model before its hook) of a case in ``layout``: the model
    ``model_name`` as :func:`~conformance.apis.fsdp2_common.standalone.wrap_model` builds it on ``mesh`` (the
    config's; ``None`` under ``replicate``) over the pool's group."""
    cls = get_model(model_name)
    return wrap_model(layout, cls, cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None), mesh, reduce_dtype,
                      ctx.group, ctx.device, ctx.world_size, hooked=hooked)


def missing_replicate() -> Optional[str]:
    """Why this torch cannot run ``replicate`` on FSDP2, or ``None``."""
    if replicate_api() is None:
        return (f"torch {torch.__version__} has no torch.distributed._composable.replicate_with_fsdp.replicate "
                "(replicate built on FSDP2)")
    return None


# -- a module with several parameter groups ------------------------------------------------------------------

_EXPERT_MESHES: Dict[Tuple[int, str], Any] = {}


def _expert_mesh(ctx: CheckContext) -> DeviceMesh:
    """A 1-D device mesh over this rank alone (``MixtureOfExperts.expert_group``), cached per group and device type;
    collective the first time (it creates the pool's singleton groups)."""
    from torch.distributed.device_mesh import DeviceMesh  # optional: see the module docstring

    group = get_model("mixture_of_experts").expert_group(ctx.group)
    key = (id(group), ctx.device.type)
    if key not in _EXPERT_MESHES:
        _EXPERT_MESHES[key] = DeviceMesh.from_group(group, ctx.device.type)
    return _EXPERT_MESHES[key]


def _shard0() -> Any:
    try:
        from torch.distributed.tensor import Shard  # torch >= 2.5
    except ImportError:  # pragma: no cover - depends on the torch version
        from torch.distributed._tensor import Shard  # type: ignore[no-redef]
    return Shard(0)


def several_groups_model(ctx: CheckContext, mesh: DeviceMesh, reduce_dtype: Optional[torch.dtype]) -> nn.Module:
    """``mixture_of_experts`` (plain build) under ``fully_shard`` on ``mesh``, with one FSDP module of several
    parameter groups: ``module.1`` (shared) an FSDP module of its own; ``module`` (the ``Sequential``) one whose
    ``shard_placement_fn`` returns ``ShardPlacementResult(Shard(0), FSDPMeshInfo(<a mesh of this rank alone>))``
    for the expert's parameters (``module.2``), so it has two parameter groups (``module.0`` and ``module.3``
    on ``mesh``, the expert on its own); the root, with no parameters of its own. The MoE layout that per-param
    meshes exist for (expert parameters on an expert-parallel mesh).

    Raises:
        ImportError: a torch without ``ShardPlacementResult`` (the plan skips the rule there).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult  # optional

    fully_shard = fsdp2_api()[0]
    kwargs = mixed_precision(reduce_dtype)
    model = get_model("mixture_of_experts").build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    expert_info = FSDPMeshInfo(_expert_mesh(ctx), shard_mesh_dim=0)  # one object for every expert parameter
    experts = {id(p) for p in model.module[2].parameters()}
    placement = ShardPlacementResult(placement=_shard0(), mesh_info=expert_info)
    fully_shard(model.module[1], mesh=mesh, **kwargs)
    fully_shard(model.module, mesh=mesh, shard_placement_fn=lambda p: placement if id(p) in experts else None,
                **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model
