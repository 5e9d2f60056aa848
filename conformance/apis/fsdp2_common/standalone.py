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
Everything FSDP2 is looked up when used: the module imports on a torch without
FSDP2.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from conformance.apis.fsdp2_common.setup import Fsdp2Config


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


def _unit_modules(cls: Any, model: nn.Module) -> List[nn.Module]:
    """The submodules of ``model`` (a ``cls``) that get their own ``fully_shard``, innermost first (root
    excluded).

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



def _wrap_units(cls: Any, model: nn.Module, wrap: Callable[[nn.Module], Any]) -> nn.Module:
    """``wrap`` (``fully_shard``, ``replicate``) on every FSDP1 unit of ``model`` (a ``cls``), innermost first, then
    the root."""
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
    _, _, FSDPModule = fsdp2_api()
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
        "mp_policy": fsdp2_api()[1](param_dtype=param_dtype, reduce_dtype=reduce_dtype)}


def shard_units(cls: Any, model: nn.Module, mesh: Any, reduce_dtype: Optional[torch.dtype], group: Any,
                device: torch.device, reshard_after_forward: Optional[bool] = None,
                param_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``model`` (a plain ``cls``) under ``fully_shard(mesh=mesh)``: one call per FSDP1 unit, innermost first, then
    the root, with ``mp_policy=MixedPrecisionPolicy(reduce_dtype=..., param_dtype=...)`` for a claim (and
    ``reshard_after_forward`` where given). A model with ``apply_fully_shard`` (``mixture_of_experts``: its
    expert on a 1-rank mesh of its own) shards itself.

    Raises:
        ValueError: such a model on a 2-D mesh (it builds its own 1-D meshes).
    """
    fully_shard = fsdp2_api()[0]
    kwargs = mixed_precision(reduce_dtype, param_dtype)
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    if hasattr(cls, "apply_fully_shard"):
        if mesh.ndim != 1:
            raise ValueError(f"{cls.name} builds its own 1-D meshes; it cannot run under HSDP")
        return cls.apply_fully_shard(model, group=group, device=device, **kwargs)
    return _wrap_units(cls, model, lambda module: fully_shard(module, mesh=mesh, **kwargs))


def wrap_model(layout: Fsdp2Config, cls: Any, model: nn.Module, mesh: Any, reduce_dtype: Optional[torch.dtype],
               group: Any, device: torch.device, world_size: int, *, hooked: bool) -> nn.Module:
    """``model`` (a plain ``cls``) as ``layout`` builds it: under ``replicate`` on FSDP2, or ``fully_shard`` on
    ``mesh`` (the hooked model on its ``layout.hooked_dim`` alone), then the config's divide factor or forced
    SUM (:func:`apply_config`)."""
    if layout.mesh == "replicate":
        kwargs = mixed_precision(reduce_dtype, layout.param_dtype)
        model = _wrap_units(cls, model, lambda module: replicate_api()(module, **kwargs))
    else:
        on = mesh[layout.hooked_dim] if hooked and layout.hooked_dim else mesh
        model = shard_units(cls, model, on, reduce_dtype, group, device, layout.reshard_after_forward,
                            layout.param_dtype)
    apply_config(model, layout, world_size)
    model.conformance_syncs_always = layout.sync_hooked_only and not hooked  # read by no_sync
    return model


# -- the reproducer's side (reads its globals when called) ---------------------------------------------------

def reproducer_known(constants: Dict[str, Any], model_cls: type) -> Dict[str, Any]:
    """What a reproducer's FSDP2 code reads as one value wherever it reads it (:func:`conformance.reproducers.parts.
    known_of`): ``cls``, the model class; ``layout`` and ``_layout()``, the case's config (its ``SETUP`` holds that
    one alone). An ``if`` on them is written as the branch the case takes."""
    configs = list(constants["SETUP"].configs.values()) if "SETUP" in constants else []
    return {"cls": model_cls, **({"layout": configs[0], "_layout": lambda: configs[0]} if len(configs) == 1 else {})}


def _layout() -> Fsdp2Config:
    if CASE.get("param_dtype") is not None:
        import dataclasses

        return dataclasses.replace(SETUP.configs[CASE["variant"]["config"]], param_dtype=CASE["param_dtype"])
    return SETUP.configs[CASE["variant"]["config"]]


def reference() -> str:
    """What the hooked copy is compared with: native FSDP2 in the case's config."""
    claim = None if CASE["reduce_dtype"] is None else str(CASE["reduce_dtype"])
    if CASE.get("param_dtype") is not None:
        claim = f"{claim} and param_dtype={CASE['param_dtype']}"
    return SETUP.reference(CASE["variant"]["config"], CASE["world_size"], claim)


def subgroup(ranks: Any) -> Any:
    """A ``subgroup`` config shards over this rank's data-parallel subgroup."""
    if _layout().mesh == "subgroup":
        return on_data_parallel_subgroup(ranks)
    return ranks


def _mesh(ranks: Any, shape: Tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if _layout().mesh == "subgroup":  # 1-D over this rank's data-parallel subgroup, not the pool
        return DeviceMesh.from_group(ranks.group, ranks.device.type)
    names = None if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(ranks.device.type, shape, mesh_dim_names=names)


_MESHES: Dict[Tuple[int, ...], Any] = {}


def mesh(ranks: Any, shape: Tuple[int, ...]) -> Any:
    """One device mesh of ``shape`` for both copies (collective when first made)."""
    if shape not in _MESHES:
        _MESHES[shape] = _mesh(ranks, shape)
    return _MESHES[shape]


def build(ranks: Any, hooked: bool) -> nn.Module:
    """The case's FSDP2 model as ``SETUP`` builds it in the case's config; hooked: ``SETUP.setter`` on every FSDP
    module, with the hook bound by ``SETUP.bind``."""
    layout = _layout()
    shape = layout.shape(ranks.world_size)
    grid = None if shape is None else mesh(ranks, shape)
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


GRAD_VIEWS = [("local gradient shard", lambda model: {fqn_without_wrappers(n): None if p.grad is None else
                                                      local(p.grad).detach() for n, p in model.named_parameters()})]
PARAM_VIEW = ("local parameter shard after the optimizer step",
              lambda model: {fqn_without_wrappers(n): local(p).detach() for n, p in model.named_parameters()})
