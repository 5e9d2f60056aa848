"""The FSDP2 setup object (torch only): what one FSDP2 hook API is, as data both builds read.

Every FSDP2 hook API (``fsdp2``: the reduce-scatter comm, ``fsdp2_all_reduce``,
``fsdp2_replica``, ``fsdp2_all_gather``: the all-gather comm) is one :class:`Fsdp2Setup`, its ``SETUP`` in its own
``standalone.py``: the ``FSDPModule`` setter that installs its hook, how the
hook is bound to what the setter takes, and its configs (:class:`Fsdp2Config`:
the device mesh, the dimension the hooked model shards on, the divide factor,
the accumulation setter, the reference). The suite's models
(``fsdp2_common/models.py``), its registration rules and every FSDP2
reproducer (this module, ``fsdp2_common/standalone.py`` and the API's
``SETUP``, written into the file as they are) read it; no code names an API.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch


#: Size of the replicate dimension of the HSDP mesh; the shard dimension takes the rest.
HSDP_REPLICATE = 2
#: Shards of a replica all-reduce hook's mesh (replicas x shards): 2 shards, the rest replicas.
REPLICA_SHARDS = 2


def divide_factor(world_size: int) -> float:
    """The factor the ``divide_factor`` configs set: twice the data-parallel size.

    Realistic (a loss summed over two micro-batches) and it keeps FSDP2's
    float16 split non-trivial: pre-divide 2 and post-divide 2 at 2 ranks,
    2 and 3 at 3 ranks.
    """
    return 2.0 * world_size


def no_division(world_size: int) -> float:
    """The factor 1.0: FSDP2 divides nothing, the reduction is a SUM (torchtitan's default under ``replicate``)."""
    return 1.0


def hsdp_shape(world_size: int) -> Tuple[int, int]:
    """``(replicate, shard)`` of the HSDP mesh: :data:`HSDP_REPLICATE` replicas, the rest shards.

    Raises:
        ValueError: ``world_size`` is not a multiple of :data:`HSDP_REPLICATE` of at least twice it.
    """
    if world_size % HSDP_REPLICATE or world_size < 2 * HSDP_REPLICATE:
        raise ValueError(f"HSDP needs a world size that is a multiple of {HSDP_REPLICATE} and at least "
                         f"{2 * HSDP_REPLICATE}, got {world_size}")
    return (HSDP_REPLICATE, world_size // HSDP_REPLICATE)


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


def mesh_shape(layout: "Fsdp2Config", world_size: int) -> Optional[Tuple[int, ...]]:
    """The device mesh's shape of ``layout`` (:attr:`Fsdp2Config.mesh`) for ``world_size`` ranks (the subgroup's
    under ``"subgroup"``): 1-D over them under ``"pool"`` and ``"subgroup"``, :func:`hsdp_shape`,
    :func:`replica_shape`; ``None`` under ``"replicate"`` (its own mesh). A reproducer holds the case's branch.

    Raises:
        ValueError: ``world_size`` does not fit the mesh; ``layout.mesh`` is none of these.
    """
    if layout.mesh == "replicate":
        return None
    if layout.mesh == "hsdp":
        return hsdp_shape(world_size)
    if layout.mesh == "replica":
        return replica_shape(world_size)
    if layout.mesh not in ("pool", "subgroup"):
        raise ValueError(f"unknown FSDP2 mesh {layout.mesh!r}")
    return (world_size,)


@dataclasses.dataclass(frozen=True)
class Fsdp2Config:
    """One FSDP2 setting an API's cases run under (the case field ``config``): how both models are built.

    Attributes:
        reference: what the hooked model is compared with, for messages; ``{mesh}`` is replaced by the mesh's
            shape (``"2x2"``), and the reduced-precision claim is appended.
        mesh: ``"pool"`` (``fully_shard`` on a 1-D mesh over the pool), ``"subgroup"`` (a 1-D mesh over this
            rank's data-parallel subgroup), ``"hsdp"`` (a 2-D ``("replicate", "shard")`` mesh,
            :func:`hsdp_shape`), ``"replica"`` (the same names, :func:`replica_shape`) or ``"replicate"``
            (``replicate`` on FSDP2, over its own 1-D mesh of the pool).
        hooked_dim: the mesh dimension the hooked model alone shards on (``"shard"``: FSDP2 then reduces
            within it, and the hook across the other); ``None``: both models on the whole mesh.
        divide_factor: ``set_gradient_divide_factor(divide_factor(world_size))`` on every FSDP module (on the
            root alone with ``divide_root_only``); ``None``: FSDP2's own average.
        force_sum: ``set_force_sum_reduction_for_comms(True)`` on every FSDP module.
        reshard_after_forward: ``fully_shard(..., reshard_after_forward=...)`` on every unit; ``None``: FSDP2's
            default (torch 2.13: ``None``, every unit but the root reshards; the root's parameters stay gathered
            for the backward). Where FSDP2 all-gathers again in the backward, it calls an all-gather comm again.
        setters: ``(FSDPModule setter, value)`` pairs called on the root of both models once built (each
            recurses): switches that change what a hook sees, such as ``set_reduce_scatter_unused_params``.
        sync_setter: the ``FSDPModule`` setter that turns synchronisation off for an accumulation micro-batch:
            the whole reduction (``set_requires_gradient_sync``: no reduce-scatter, no comm call) or, where
            FSDP2 all-reduces across replicas, that all-reduce only (``set_requires_all_reduce``).
        sync_hooked_only: the accumulation setter on the hooked model alone; the reference synchronises every
            micro-batch. For a setter that does not reach the hook: ``set_requires_all_reduce(False)`` with a
            replica all-reduce hook on a 1-D mesh, which FSDP2 still calls on every micro-batch (torch 2.13,
            ``scripts/fsdp2_switches_evidence.py``), as native HSDP all-reduces when nothing is set.
        param_dtype: ``MixedPrecisionPolicy(param_dtype=...)`` of both models (a spec's claimed parameter
            dtype, ``HookSpec.param_dtype``, set per case); ``None``: the models' own dtype.
    """

    reference: str
    mesh: str = "pool"
    hooked_dim: Optional[str] = None
    divide_factor: Optional[Callable[[int], float]] = None
    divide_root_only: bool = False
    force_sum: bool = False
    reshard_after_forward: Optional[bool] = None
    sync_setter: str = "set_requires_gradient_sync"
    setters: Tuple[Tuple[str, bool], ...] = ()
    sync_hooked_only: bool = False
    param_dtype: Optional[torch.dtype] = None

    def shape(self, world_size: int) -> Optional[Tuple[int, ...]]:
        """The device mesh's shape for ``world_size`` ranks (the subgroup's under ``"subgroup"``); ``None``
        under ``replicate`` (its own mesh)."""
        return mesh_shape(self, world_size)

    @property
    def methods(self) -> Tuple[str, ...]:
        """The ``FSDPModule`` methods the config calls, besides the API's setter."""
        return (("set_gradient_divide_factor",) if self.divide_factor else ()) + \
            (("set_force_sum_reduction_for_comms",) if self.force_sum else ()) + tuple(n for n, _ in self.setters)

    def premul_sum(self, reduce_dtype: Optional[torch.dtype], param_dtype: torch.dtype = torch.float32) -> bool:
        """Whether FSDP2 reduce-scatters with ``PREMUL_SUM(1/factor)`` here (``_get_gradient_divide_factors``):
        a divide factor, no forced SUM, a float32 or bfloat16 reduce dtype, under ``fully_shard``."""
        return (self.divide_factor is not None and not self.force_sum and self.mesh != "replicate"
                and (reduce_dtype or param_dtype) in (torch.float32, torch.bfloat16))


@dataclasses.dataclass(frozen=True)
class Fsdp2Setup:
    """An FSDP2 hook API, as both the suite's models and a reproducer build it.

    Attributes:
        setter: the ``FSDPModule`` method that installs the hook on one FSDP module (it does not recurse:
            it is called on every one), e.g. ``"set_custom_reduce_scatter"``.
        bind: ``bind(hook, state, name, mesh)``: the object the setter gets for the spec's ``hook`` (its
            ``state`` factory, its ``name`` for messages, the case's device mesh, ``None`` under
            ``replicate``): :func:`bind_comm`, :func:`bind_hook`, :func:`bind_to_replicas`. A reproducer calls it
            as it is; the suite through :meth:`bound`, which checks what it made.
        configs: the API's configs by name (the case field ``config``).
        comm_kind: the comm protocol a comm API's hook must make (a key of :data:`COMM_KINDS`), ``None`` for a hook
            FSDP2 calls as a function.
    """

    setter: str
    bind: Callable[[Any, Any, str, Any], Any]
    configs: Mapping[str, Fsdp2Config]
    comm_kind: Optional[str] = None

    def bound(self, hook: object, state: object, name: str,
              mesh: Optional[torch.distributed.device_mesh.DeviceMesh]) -> Any:
        """What the setter gets for the spec's ``hook`` (:attr:`bind`), on the suite's side: where a comm's factory
        made it, checked to be a comm of :attr:`comm_kind`.

        Raises:
            TypeError: the factory returned no comm of that kind (the message names the hook and the protocol).
        """
        made = self.bind(hook, state, name, mesh)
        if self.comm_kind is not None and made is not hook and \
                (not callable(getattr(made, "allocate", None)) or not callable(made)):
            article = "an" if self.comm_kind[0] in "AEIOU" else "a"
            raise TypeError(f"the factory of hook {name!r} returned {made!r}, not {article} {self.comm_kind} comm "
                            f"(an object with allocate() and {COMM_KINDS[self.comm_kind]})")
        return made

    def reference(self, config: str, world_size: int, claim: Optional[str]) -> str:
        """What a case of ``config`` compares the hooked model with (``claim``: the reduce dtype's name)."""
        layout = self.configs[config]
        shape = layout.shape(world_size)
        text = layout.reference.format(mesh="x".join(map(str, shape or (world_size,))))
        return text + ("" if claim is None else f" with reduce_dtype={claim}")


#: What a comm of each kind is, for :meth:`Fsdp2Setup.bound`'s error: ``ReduceScatter`` and ``AllGather`` (the two
#: ``torch.distributed.fsdp._fully_shard._fsdp_api`` comm protocols).
COMM_KINDS = {"ReduceScatter": "__call__(output_tensor, input_tensor, group, op, async_op)",
              "AllGather": "__call__(output_tensor, input_tensor, group, async_op)"}


def with_config(setup: Fsdp2Setup, config: str) -> Fsdp2Setup:
    """``setup`` with its config ``config`` alone: a reproducer's ``SETUP``, which builds one case."""
    return dataclasses.replace(setup, configs={config: setup.configs[config]})


def setup_constants(setup: Fsdp2Setup, case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE`` for an API of the FSDP2 family (each API's
    ``reproducer_constants``): ``SETUP``, ``setup`` with the case's config alone (with the case's claimed
    ``param_dtype``), and ``REFERENCE``, what the hooked copy is compared with (native FSDP2 in that config,
    with the claim); nothing for a case of no config of the API."""
    config = case["variant"].get("config")
    if config not in setup.configs:
        return {}
    claim = None if case["reduce_dtype"] is None else str(case["reduce_dtype"])
    if case.get("param_dtype") is not None:
        claim = f"{claim} and param_dtype={case['param_dtype']}"
        setup = dataclasses.replace(setup, configs={config: dataclasses.replace(
            setup.configs[config], param_dtype=case["param_dtype"])})
    return {"SETUP": with_config(setup, config), "REFERENCE": setup.reference(config, case["world_size"], claim)}


def bind_comm(hook: Any, state: object, name: str, mesh: object) -> Any:  # Any: the spec's comm, or its class
    """A custom comm, one for every module: the spec's object, or what its zero-argument factory (a comm class)
    makes (:meth:`Fsdp2Setup.bound` checks that it made a comm)."""
    return hook if not isinstance(hook, type) and callable(getattr(hook, "allocate", None)) else hook()


def bind_hook(hook: object, state: object, name: str, mesh: object) -> Any:
    """A hook FSDP2 calls as ``hook(tensor)``: the spec's hook itself."""
    return hook


def bind_to_replicas(hook: Callable[..., object], state: Callable[[torch.distributed.ProcessGroup], object], name: str,
                     mesh: torch.distributed.device_mesh.DeviceMesh) -> Any:
    """A replica all-reduce hook: ``hook(state, tensor)`` with ``state = STATE(the mesh's "replicate" group)``."""
    return functools.partial(hook, state(mesh.get_group("replicate")))
