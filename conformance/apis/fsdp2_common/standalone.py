"""FSDP2's part of a standalone reproducer (torch only): units, the builds, and the reproducer's functions.

A reproducer of an FSDP2 case holds what the case runs of this module, after
the setup types (``fsdp2_common/setup.py``), and the API's ``SETUP`` with the
case's config alone (:func:`~conformance.apis.fsdp2_common.setup.with_config`,
:mod:`conformance.reproducers.sources`); the suite builds its FSDP2 models with the
same functions (:func:`wrap_model`), so the file builds them as the suite did:
``fully_shard`` (or ``replicate`` on FSDP2) on the model's FSDP1 units,
innermost first, then the root, with ``MixedPrecisionPolicy(reduce_dtype=...)``
for a reduced-precision claim, and a config's divide factor or forced SUM on
every FSDP module. The reproducer's functions at the end read the globals
``CASE``, ``MODEL``, ``HOOK``, ``STATE`` and ``SETUP`` only when called.
On a torch without FSDP2 the module still imports (:func:`fsdp2_api` is then ``None``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from conformance.apis.fsdp2_common.setup import Fsdp2Config, mesh_shape
if TYPE_CHECKING:  # pragma: no cover - the loop's type; a reproducer defines it (standalone_main.py)
    from conformance.models.base import ReferenceModel
    from conformance.shared.standalone_main import Ranks


try:  # FSDP2: public in torch.distributed.fsdp from torch 2.6; 2.4 and 2.5 have it under _composable.fsdp
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # a torch without FSDP2: the module still imports, and fsdp2_api() is None
        FSDPModule = MixedPrecisionPolicy = fully_shard = None


def fsdp2_api() -> Optional[Tuple[Any, Any, Any]]:
    """``(fully_shard, MixedPrecisionPolicy, FSDPModule)``, or ``None`` on a torch without FSDP2 (a reproducer
    imports them from where the torch that wrote it has them: :mod:`conformance.reproducers.sources`)."""
    return None if fully_shard is None else (fully_shard, MixedPrecisionPolicy, FSDPModule)


def _unit_modules(cls: Type[ReferenceModel], model: nn.Module) -> List[nn.Module]:
    """The submodules of ``model`` (a ``cls``) that get their own ``fully_shard``, innermost first (root
    excluded).

    The same units as the model's FSDP1 build: the submodules its
    ``_wrap_nested`` wraps, plus those its root ``auto_wrap_policy`` would wrap
    (``always_wrap_policy``: every submodule holding parameters;
    ``ModuleWrapPolicy``: instances of its classes).
    """
    units: List[nn.Module] = []
    model._wrap_nested(lambda module: units.append(module) or module)  # records each unit, wraps none
    if cls._root_fsdp_kwargs({}).get("auto_wrap_policy") is not None:
        classes = getattr(cls._root_fsdp_kwargs({})["auto_wrap_policy"], "_module_classes", None)
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



def _wrap_units(cls: Type[ReferenceModel], model: nn.Module, wrap: Callable[[nn.Module], Any]) -> nn.Module:
    """``wrap`` (``fully_shard``, ``replicate``: each shards its module in place and returns it) on every FSDP1 unit
    of ``model`` (a ``cls``), innermost first, then the root: the units the model's ``_wrap_nested`` names, wrapped
    as it names them, or those its root ``auto_wrap_policy`` would wrap (:func:`_unit_modules`)."""
    if cls._root_fsdp_kwargs({}).get("auto_wrap_policy") is None:
        model._wrap_nested(wrap)
    else:
        for unit in _unit_modules(cls, model):
            wrap(unit)
    wrap(model)
    return model



def replicate_api() -> Optional[Any]:
    """``replicate`` built on FSDP2 (``torch.distributed._composable.replicate_with_fsdp.replicate``), or
    ``None`` on a torch without it (a private module PyTorch may move; torchtitan's data parallelism)."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # optional: probed
    except ImportError:
        return None
    return replicate



def fsdp_modules(model: nn.Module) -> List[nn.Module]:
    """Every FSDP2 module of ``model`` (root included); settings are per module in FSDP2."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def apply_config(model: nn.Module, layout: Fsdp2Config, world_size: int) -> None:
    """Set the config's divide factor / forced SUM on every FSDP module (neither recurses), the divide factor on
    the root alone where the config says so, and the config's other setters on the root (they recurse)."""
    if layout.setters:
        for name, value in layout.setters:
            getattr(model, name)(value)
    if layout.divide_factor is not None:
        for module in [model] if layout.divide_root_only else fsdp_modules(model):
            module.set_gradient_divide_factor(layout.divide_factor(world_size))
    if layout.force_sum:
        for module in fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)


def mixed_precision(reduce_dtype: Optional[torch.dtype], param_dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
    """``fully_shard``/``replicate`` keyword arguments for a claim: ``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)``
    for a reduced-precision one (with ``param_dtype=...`` for a claimed parameter dtype), none for full precision."""
    return {} if reduce_dtype is None and param_dtype is None else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}


def wrap_model(layout: Fsdp2Config, cls: Type[ReferenceModel], model: nn.Module, mesh: Optional[DeviceMesh],
               reduce_dtype: Optional[torch.dtype], group: Optional[torch.distributed.ProcessGroup],
               device: torch.device, world_size: int, *, hooked: bool) -> nn.Module:
    """``model`` (a plain ``cls``) as ``layout`` builds it: one ``fully_shard(mesh=mesh)`` (or ``replicate`` on
    FSDP2) per FSDP1 unit, innermost first, then the root (:func:`_wrap_units`), with
    ``mp_policy=MixedPrecisionPolicy(reduce_dtype=..., param_dtype=...)`` for a claim; the hooked model on the
    mesh's ``layout.hooked_dim`` alone; then the config's divide factor, forced SUM and setters
    (:func:`apply_config`). A model with ``apply_fully_shard`` (``mixture_of_experts``: its expert on a 1-rank
    mesh of its own) shards itself. Each ``if`` reads the config or the model class alone: a reproducer holds
    its case's branch (:func:`reproducer_known`).

    Raises:
        ValueError: such a model on a 2-D mesh (it builds its own 1-D meshes).
    """
    kwargs = mixed_precision(reduce_dtype, layout.param_dtype)
    if layout.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = layout.reshard_after_forward
    if layout.hooked_dim is not None and hooked:
        mesh = mesh[layout.hooked_dim]
    if layout.mesh == "replicate":
        model = _wrap_units(cls, model, lambda module: replicate_api()(module, **kwargs))
    elif hasattr(cls, "apply_fully_shard"):
        if mesh.ndim != 1:
            raise ValueError(f"{cls.name} builds its own 1-D meshes; it cannot run under HSDP")
        model = cls.apply_fully_shard(model, group=group, device=device, **kwargs)
    else:
        model = _wrap_units(cls, model, lambda module: fully_shard(module, mesh=mesh, **kwargs))
    if layout.methods:
        apply_config(model, layout, world_size)
    if layout.sync_hooked_only:
        model.conformance_syncs_always = not hooked  # read by no_sync
    return model


# -- the reproducer's side (reads its globals when called) ---------------------------------------------------

def reproducer_known(constants: Dict[str, Any], model_cls: type) -> Dict[str, Any]:
    """What a reproducer's FSDP2 code reads as one value wherever it reads it (:func:`conformance.reproducers.parts.
    known_of`): ``cls``, the model class; ``SETUP``, ``layout`` and ``_layout()``, the API's setup and the case's
    config (its ``SETUP`` holds that one alone). An ``if`` on them is written as the branch the case takes, and
    a field read of them as its value (:func:`conformance.reproducers.sources.written_code`): the file holds no
    setup object."""
    setup = constants.get("SETUP")
    configs = list(setup.configs.values()) if setup is not None else []
    if len(configs) != 1:
        return {"cls": model_cls}
    return {"cls": model_cls, "SETUP": setup, "layout": configs[0], "_layout": lambda: configs[0]}


def _layout() -> Fsdp2Config:
    """The case's config (the file's ``SETUP`` holds it alone, with the case's claimed ``param_dtype``)."""
    return SETUP.configs[CASE["variant"]["config"]]


def subgroup(ranks: Ranks) -> Ranks:
    """A ``subgroup`` config shards over this rank's data-parallel subgroup."""
    if _layout().mesh == "subgroup":
        return on_data_parallel_subgroup(ranks)
    return ranks


#: ``init_device_mesh`` made once a shape (and dimension names) in a reproducer's process: one mesh for both copies.
device_mesh = functools.lru_cache(maxsize=None)(init_device_mesh)  # one mesh a shape: making one is a collective


@functools.lru_cache(maxsize=None)
def subgroup_mesh(ranks: Ranks) -> DeviceMesh:
    """The 1-D mesh over this rank's data-parallel subgroup (``subgroup``), made once for both copies."""
    return DeviceMesh.from_group(ranks.group, ranks.device.type)


def case_mesh(ranks: Ranks, shape: Tuple[int, ...]) -> DeviceMesh:
    """The device mesh of ``shape`` both copies shard over (each made once: :data:`device_mesh`, :func:`subgroup_mesh`):
    1-D over this rank's data-parallel subgroup under ``subgroup``, 2-D ``("replicate", "shard")`` under HSDP and the
    replica mesh. One ``return`` in each config: a reproducer writes it at its call."""
    if _layout().mesh == "subgroup":
        return subgroup_mesh(ranks)
    if _layout().mesh in ("hsdp", "replica"):
        return device_mesh(ranks.device.type, shape, mesh_dim_names=("replicate", "shard"))
    return device_mesh(ranks.device.type, shape)


def build(ranks: Ranks, hooked: bool) -> nn.Module:
    """The case's FSDP2 model as ``SETUP`` builds it in the case's config; hooked: ``SETUP.setter`` on every FSDP
    module, with the hook bound by ``SETUP.bind``."""
    layout = _layout()
    grid = None if layout.mesh == "replicate" else case_mesh(ranks, mesh_shape(layout, ranks.world_size))
    model = wrap_model(layout, MODEL, MODEL.plain(group=ranks.group, device=ranks.device), grid,
                       CASE["reduce_dtype"], ranks.group, ranks.device, ranks.world_size, hooked=hooked)
    if hooked:
        hook = SETUP.bind(HOOK, STATE, CASE["hook"], grid)
        for module in fsdp_modules(model):
            getattr(module, SETUP.setter)(hook)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient accumulation: the config's ``sync_setter(False)`` for the micro-batch (none on a reference
    built to synchronise every micro-batch, ``Fsdp2Config.sync_hooked_only``)."""
    if getattr(model, "conformance_syncs_always", False):
        yield
        return
    setter = getattr(model, _layout().sync_setter)
    setter(False)
    try:
        yield
    finally:
        setter(True)


GRADIENT, PARAMETER = "local gradient shard", "local parameter shard after the optimizer step"


def tensors(model: nn.Module, what: str) -> Dict[str, Any]:
    """``{FQN: this rank's shard}`` of ``model`` (``DTensor.to_local()``): each parameter's gradient (``GRADIENT``)
    or the parameter itself (``PARAMETER``). FSDP2 inserts no wrapper prefix into the FQNs. ``local`` takes a name
    (``t``), so a reproducer writes its one line in place."""
    chosen = {n: p.grad if what == GRADIENT else p for n, p in model.named_parameters()}
    return {n: local(t) for n, t in chosen.items()}
