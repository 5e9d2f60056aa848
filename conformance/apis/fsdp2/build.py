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

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

# The unit walk, the meshes' shapes, the configs and the API lookups live in the API's standalone part, which
# reproducers copy as it is (torch only); imported from here too.
from conformance.apis.fsdp2.standalone import (HSDP_REPLICATE, _unit_modules, apply_config,  # noqa: F401
                                               divide_factor, fsdp2_api, fsdp_modules, hsdp_shape, replicate_api,
                                               replicate_units, shard_units)
from conformance.models import get_model

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


# -- models ----------------------------------------------------------------------------------


def build_fsdp2(model_name: str, ctx: Any, mesh: Any, *, reduce_dtype: Optional[torch.dtype]) -> nn.Module:
    """The reference model under ``fully_shard`` (:func:`~conformance.apis.fsdp2.standalone.shard_units`): one
    call per FSDP1 unit, innermost first, then the root, on ``mesh`` (1-D, or 2-D for HSDP).

    Raises:
        ValueError: a model that builds its own meshes (``mixture_of_experts``) on a 2-D mesh.
    """
    cls = get_model(model_name)
    return shard_units(cls, cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None), mesh, reduce_dtype,
                       ctx.group, ctx.device)


def missing_replicate() -> Optional[str]:
    """Why this torch cannot run ``replicate`` on FSDP2, or ``None``."""
    if replicate_api() is None:
        return (f"torch {torch.__version__} has no torch.distributed._composable.replicate_with_fsdp.replicate "
                "(replicate built on FSDP2)")
    return None


def build_replicate(model_name: str, ctx: Any, *, reduce_dtype: Optional[torch.dtype],
                    divide_factor: Optional[float] = None) -> nn.Module:
    """The reference model under ``replicate`` on FSDP2 (:func:`~conformance.apis.fsdp2.standalone.replicate_units`),
    ``set_gradient_divide_factor(divide_factor)`` on every module where given (``1.0``: a SUM, torchtitan's
    default)."""
    model = get_model(model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    return replicate_units(model, reduce_dtype, divide_factor)
