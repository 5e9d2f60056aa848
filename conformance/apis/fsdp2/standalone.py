"""FSDP2's part of a standalone reproducer (torch only): units, meshes, configs, and the three hook APIs' builds.

This module is written, as it is, into every reproducer of an ``fsdp2``,
``fsdp2_all_reduce`` or ``fsdp2_replica`` case (:mod:`conformance.reproducers`);
the suite builds its FSDP2 models with the same functions (``build.py``), so the
file builds them as the suite did: ``fully_shard`` (or ``replicate`` on FSDP2)
on the model's FSDP1 units, innermost first, then the root, with
``MixedPrecisionPolicy(reduce_dtype=...)`` for a reduced-precision claim, and a
config's divide factor or forced SUM on every FSDP module. The reproducer's
functions at the end read the globals ``CASE``, ``MODEL``, ``HOOK`` and ``STATE``
only when called. Everything FSDP2 is looked up when used: the module imports
on a torch without FSDP2.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn


#: Size of the replicate dimension of the HSDP mesh; the shard dimension takes the rest.
HSDP_REPLICATE = 2


def divide_factor(world_size: int) -> float:
    """The factor the ``divide_factor`` configs set: twice the data-parallel size.

    Realistic (a loss summed over two micro-batches) and it keeps FSDP2's
    float16 split non-trivial: pre-divide 2 and post-divide 2 at 2 ranks,
    2 and 3 at 3 ranks.
    """
    return 2.0 * world_size



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



def hsdp_shape(world_size: int) -> Tuple[int, int]:
    if world_size % HSDP_REPLICATE or world_size < 2 * HSDP_REPLICATE:
        raise ValueError(f"HSDP needs a world size that is a multiple of {HSDP_REPLICATE} and at least "
                         f"{2 * HSDP_REPLICATE}, got {world_size}")
    return (HSDP_REPLICATE, world_size // HSDP_REPLICATE)



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



def _wrap_units(model: nn.Module, wrap: Callable[[nn.Module], Any]) -> nn.Module:
    """``wrap`` (``fully_shard``, ``replicate``) on every FSDP1 unit of ``model``, innermost first, then the root."""
    for unit in _unit_modules(model):
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


#: The configs that set a divide factor, and on which FSDP modules: every one, or the root alone (the others
#: keep FSDP2's own average, PyTorch issue 157485).
DIVIDE_FACTOR_CONFIGS = {"divide_factor": "every", "divide_factor_force_sum": "every", "divide_factor_some": "root",
                         "hsdp_divide_factor": "every"}
#: The configs on a 2-D (replicate x shard) mesh; ``hsdp_divide_factor`` sets the divide factor there, which
#: must divide the SUM over every rank as the flattened 1-D mesh does (PyTorch issue 155903).
HSDP_CONFIGS = ("hsdp", "hsdp_divide_factor")


def apply_config(model: nn.Module, config: str, world_size: int) -> None:
    """Set the config's divide factor / forced SUM on every FSDP module (neither recurses), the divide factor of
    ``divide_factor_some`` on the root module alone."""
    for module in fsdp_modules(model):
        if DIVIDE_FACTOR_CONFIGS.get(config) == "every" or (config == "divide_factor_some" and module is model):
            module.set_gradient_divide_factor(divide_factor(world_size))
        if config in ("force_sum", "divide_factor_force_sum"):
            module.set_force_sum_reduction_for_comms(True)


def mixed_precision(reduce_dtype: Optional[torch.dtype]) -> Dict[str, Any]:
    """``fully_shard``/``replicate`` keyword arguments for a claim: ``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)``
    for a reduced-precision one, none for full precision."""
    return {} if reduce_dtype is None else {"mp_policy": fsdp2_api()[1](reduce_dtype=reduce_dtype)}


def shard_units(cls: Any, model: nn.Module, mesh: Any, reduce_dtype: Optional[torch.dtype], group: Any,
                device: torch.device) -> nn.Module:
    """``model`` (a plain ``cls``) under ``fully_shard(mesh=mesh)``: one call per FSDP1 unit, innermost first, then
    the root, with ``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)`` for a reduced-precision claim. A model
    with ``apply_fully_shard`` (``mixture_of_experts``: its expert on a 1-rank mesh of its own) shards itself.

    Raises:
        ValueError: such a model on a 2-D mesh (it builds its own 1-D meshes).
    """
    fully_shard = fsdp2_api()[0]
    kwargs = mixed_precision(reduce_dtype)
    if hasattr(cls, "apply_fully_shard"):
        if mesh.ndim != 1:
            raise ValueError(f"{cls.name} builds its own 1-D meshes; it cannot run under HSDP")
        return cls.apply_fully_shard(model, group=group, device=device, **kwargs)
    return _wrap_units(model, lambda module: fully_shard(module, mesh=mesh, **kwargs))


def replicate_units(model: nn.Module, reduce_dtype: Optional[torch.dtype], divide_factor: Optional[float]) -> nn.Module:
    """``model`` under ``replicate`` on FSDP2, one call per FSDP1 unit, innermost first, then the root, over the
    default 1-D ``("replicate",)`` mesh; ``set_gradient_divide_factor(divide_factor)`` on every module where given."""
    kwargs = mixed_precision(reduce_dtype)
    _wrap_units(model, lambda module: replicate_api()(module, **kwargs))
    if divide_factor is not None:
        for module in fsdp_modules(model):
            module.set_gradient_divide_factor(divide_factor)
    return model


def make_comm(hook: Any, name: str) -> Any:
    """A comm spec's comm: the object itself, or what its zero-argument factory (a comm class) returns.

    Raises:
        TypeError: the factory returned no ``ReduceScatter`` comm.
    """
    if not isinstance(hook, type) and callable(getattr(hook, "allocate", None)):
        return hook
    comm = hook()
    if not callable(getattr(comm, "allocate", None)) or not callable(comm):
        raise TypeError(f"the factory of hook {name!r} returned {comm!r}, not a ReduceScatter comm "
                        "(an object with allocate() and __call__(output_tensor, input_tensor, group, op, async_op))")
    return comm


# -- the reproducer's side (reads its globals when called) ---------------------------------------------------

def reference() -> str:
    """What the hooked copy is compared with: native FSDP2 for the API (the same mesh, or native HSDP)."""
    claim = "" if CASE["reduce_dtype"] is None else f" with reduce_dtype={CASE['reduce_dtype']}"
    if CASE["api"] == "fsdp2":
        return "native fully_shard" + claim
    if CASE["api"] == "fsdp2_replica":
        return "native HSDP on the replicas x shards mesh" + claim
    config = CASE["variant"].get("config")
    return ("native HSDP without the hook" if config == "hsdp" else "replicate (on FSDP2) without the hook") + claim
#: Replicas x shards of a replica all-reduce hook's mesh: 2 shards, the rest replicas.
REPLICA_SHARDS = 2


def replica_shape(world_size: int) -> Tuple[int, int]:
    """``(replicas, shards)`` of a replica case's mesh: :data:`REPLICA_SHARDS` shards, ``world_size / 2``
    replicas (2 at 4 ranks, 3 at 6); at 2 ranks, 2 replicas of 1 shard, where FSDP2 copies the gradient into
    the hook's tensor whole (the long run's layout: the cheapest that calls the hook across replicas).

    Raises:
        ValueError: ``world_size`` is odd, or under 4 and not 2.
    """
    if world_size == 2:
        return (2, 1)
    if world_size % REPLICA_SHARDS or world_size < 2 * REPLICA_SHARDS:
        raise ValueError(f"a replica case needs 2 ranks or an even world size of at least {2 * REPLICA_SHARDS} "
                         f"(replicas x {REPLICA_SHARDS} shards), got {world_size}")
    return (world_size // REPLICA_SHARDS, REPLICA_SHARDS)


def subgroup(ranks: Any) -> Any:
    """The ``subgroup`` config shards over this rank's data-parallel subgroup."""
    return on_data_parallel_subgroup(ranks) if CASE["variant"].get("config") == "subgroup" else ranks


def _mesh(ranks: Any, shape: Tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if len(shape) == 1 and ranks.world_size != torch.distributed.get_world_size():
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
    """The case's FSDP2 model, by API: ``fsdp2`` (``set_custom_reduce_scatter`` on every FSDP module, in the
    config), ``fsdp2_all_reduce`` (``set_all_reduce_hook`` under native HSDP or ``replicate``),
    ``fsdp2_replica`` (native HSDP on a replicas x 2 mesh; hooked: the shard dimension alone, and the hook,
    ``HOOK(STATE(replica_group), tensor)``, all-reduces across replicas)."""
    api, config, claim = CASE["api"], CASE["variant"].get("config"), CASE["reduce_dtype"]
    model = MODEL.build(group=ranks.group, device=ranks.device, fsdp_kwargs=None)
    if api == "fsdp2":
        if config == "replicate":  # FSDP2 calls the comm's allocate there, never the comm
            model = replicate_units(model, claim, None)
        else:
            shape = hsdp_shape(ranks.world_size) if config in HSDP_CONFIGS else (ranks.world_size,)
            model = shard_units(MODEL, model, mesh(ranks, shape), claim, ranks.group, ranks.device)
        apply_config(model, config, ranks.world_size)
        if hooked:
            comm = make_comm(HOOK, CASE["hook"])
            for module in fsdp_modules(model):
                module.set_custom_reduce_scatter(comm)
        return model
    if api == "fsdp2_all_reduce":
        if config == "hsdp":
            model = shard_units(MODEL, model, mesh(ranks, hsdp_shape(ranks.world_size)), claim, ranks.group,
                                ranks.device)
        else:
            model = replicate_units(model, claim, 1.0 if config == "replicate_sum" else None)
        if hooked:
            for module in fsdp_modules(model):
                module.set_all_reduce_hook(HOOK)
        return model
    grid = mesh(ranks, replica_shape(ranks.world_size))
    if not hooked:
        return shard_units(MODEL, model, grid, claim, ranks.group, ranks.device)
    model = shard_units(MODEL, model, grid["shard"], claim, ranks.group, ranks.device)
    state = STATE(grid.get_group("replicate"))
    for module in fsdp_modules(model):
        module.set_all_reduce_hook(lambda tensor: HOOK(state, tensor))
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's gradient accumulation: ``set_requires_gradient_sync(False)``, or under HSDP (a comm's ``hsdp``
    config, every all-reduce hook's) ``set_requires_all_reduce(False)``, for the micro-batch."""
    hsdp = CASE["api"] == "fsdp2_all_reduce" or CASE["variant"].get("config") in HSDP_CONFIGS
    setter = getattr(model, "set_requires_all_reduce" if hsdp else "set_requires_gradient_sync")
    setter(False)
    try:
        yield
    finally:
        setter(True)




def _detached(t: Any) -> Any:
    return None if t is None else t.detach()


def _named(model: nn.Module, read: Callable[[Any], Any], grads: bool = True) -> Dict[str, Any]:
    return {fqn_without_wrappers(n): read(p.grad if grads else p) for n, p in model.named_parameters()}


GRAD_VIEWS: List[Tuple[str, Callable[[nn.Module], Dict[str, Any]]]] = [
    ("local gradient shard", lambda model: _named(model, lambda t: _detached(local(t)))),
]
PARAM_VIEW = ("local parameter shard after the optimizer step",
              lambda model: _named(model, lambda t: _detached(local(t)), grads=False))
