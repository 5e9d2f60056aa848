"""``MixtureOfExperts`` from PyTorch's ``torch/testing/_internal/common_fsdp.py``:
one layer's parameters differ per rank and live in an FSDP unit of their own,
over a process group of that rank alone."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, quiet_construct, rank_generator

__all__ = ["MixtureOfExperts", "D_EXPERT", "D_INPUT", "D_SHARED"]

D_EXPERT = 23
D_SHARED = 12
D_INPUT = 8

#: ``(default process group, world size, [singleton group of global rank r, ...])``
#: for the current default process group; replaced when that group changes
#: (destroyed and initialized again).
_SINGLETONS: Optional[Tuple[Any, int, List[Any]]] = None

#: FSDP1 clamps any sharding strategy to ``NO_SHARD`` on a 1-rank group and
#: warns; for the expert unit that is the design ("world size 1 means no shard").
_NO_SHARD_WARNING = "FSDP is switching to use `NO_SHARD`"


def _singleton_groups() -> List[Any]:
    """One process group per global rank ``r`` holding ``[r]`` alone, created
    once per default process group and cached.

    The first call is collective over the default process group:
    ``dist.new_group`` must be entered by every rank of the default group for
    every new group, in the same order, so every rank creates all
    ``world_size`` singletons ``[0], [1], ...`` in rank order."""
    global _SINGLETONS
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "MixtureOfExperts needs an initialized default process group to create "
            "the per-rank expert groups"
        )
    world = dist.group.WORLD
    world_size = dist.get_world_size()
    cached = _SINGLETONS
    if cached is not None and cached[0] is world and cached[1] == world_size:
        return cached[2]
    groups = [dist.new_group([r]) for r in range(world_size)]
    _SINGLETONS = (world, world_size, groups)
    return groups


def _rank_of(group: Any) -> int:
    if group is not None:
        return int(group.rank())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raise ValueError("group=None needs an initialized default process group to know the rank")


class MixtureOfExperts(ReferenceModel):
    """``module = Sequential(Linear(8, 12), shared Linear(12, 23),
    expert Linear(23, 12), Linear(12, 8))`` (no activations), applied to ``x``.

    Mirrors ``MixtureOfExperts`` of ``torch/testing/_internal/common_fsdp.py``
    (``d_input=8``, ``d_shared=12``, ``d_expert=23``; ``FSDPInitMode.RECURSIVE``,
    ``deterministic=True``), plus a root FSDP unit on top.

    * Parameters (float32): ``module.0.{weight (12, 8), bias (12,)}``,
      ``module.1.{weight (23, 12), bias (23,)}`` (shared),
      ``module.2.{weight (12, 23), bias (12,)}`` (expert),
      ``module.3.{weight (8, 12), bias (8,)}``. The expert is created under
      ``torch.manual_seed(42 + rank)`` (``rank = group.rank()``), so it differs
      across ranks; everything else under ``torch.manual_seed(0)`` (shared,
      then ``module.0``, then ``module.3``, PyTorch's order), so it is the same
      on every rank. Expert parameters carry ``p.expert = True`` (plain build
      and ``use_orig_params=True``; with ``use_orig_params=False`` the expert
      unit's flat parameter is marked instead).
    * FSDP units: 3: ``FSDP(module.1)`` over ``group``, ``FSDP(module.2)``
      over :meth:`expert_group` (this rank alone, so its gradient is never
      reduced across ranks and it is never sharded; FSDP1 clamps the strategy
      to ``NO_SHARD`` there), and the root over ``group`` (holding
      ``module.0`` and ``module.3``).
    * Input: ``(x,)``, ``x`` of shape ``(4, 8)``, float32, ``torch.rand`` from
      the rank's generator. Output ``(4, 8)``; loss ``output.sum()``.

    ``fsdp_kwargs=None`` gives the plain module with the expert unwrapped; a
    data-parallel reference must then leave the ``p.expert`` gradients
    unreduced (PyTorch's ``run_backward`` skips them).

    The FSDP build is collective over the default process group the first
    time (it creates one singleton group per global rank, see
    :meth:`expert_group`), so every rank of the default group must call it,
    even when ``group`` is a sub-group.

    FSDP2: wrap a plain build with :meth:`apply_fully_shard`, which calls
    ``fully_shard`` on ``model.module[1]`` with a 1-D mesh over ``group``, on
    ``model.module[2]`` with a 1-D mesh over :meth:`expert_group`, and on the
    model with the ``group`` mesh.

    Comm hooks (FSDP1, seen on torch 2.13, 2 gloo ranks): ``register_comm_hook``
    on the root gives every unit the same hook and state, the expert unit
    included. A state over ``group`` therefore all-reduces the expert
    gradients across ``group`` (they stop being local), and because the expert
    unit is ``NO_SHARD`` it calls the hook the all-reduce way
    (``hook(state, grad)``): a ``FULL_SHARD`` hook that needs the
    reduce-scatter signature (``hook(state, grad, output)``) raises
    ``TypeError`` there.

    Deviations from PyTorch: each PyTorch construction has every rank call
    ``new_group([group.rank()])`` with its own rank list; here every rank
    creates all singletons ``[0], [1], ...`` once per default group, and they
    are cached. PyTorch's ``init`` does not wrap the top-level module; here a
    root is added. PyTorch also builds (and discards) a
    ``NestedWrappedModule`` body under seed 0 before the expert, so the
    values here differ from PyTorch's.
    """

    name = "mixture_of_experts"
    fsdp_units = 3

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        torch.manual_seed(42 + rank)  # each rank has different expert parameters
        expert = nn.Linear(D_EXPERT, D_SHARED)
        for p in expert.parameters():
            p.expert = True  # type: ignore[attr-defined]
        self.num_expert_params = sum(p.numel() for p in expert.parameters())
        torch.manual_seed(0)  # every other parameter is the same on every rank
        shared = nn.Linear(D_SHARED, D_EXPERT)
        self.module = nn.Sequential(
            nn.Linear(D_INPUT, D_SHARED),
            shared,
            expert,
            nn.Linear(D_SHARED, D_INPUT),
        )

    @classmethod
    def _construct(cls, world_size: int) -> "MixtureOfExperts":  # pragma: no cover
        raise TypeError("MixtureOfExperts is constructed by build(), which knows the rank")

    @classmethod
    def expert_group(cls, group: Any = None) -> Any:
        """This rank's singleton process group (the expert unit's group).

        Collective on the first call per default process group (see the class
        docstring). ``group`` is accepted for symmetry with ``build``; the
        singleton is keyed by this process's global rank, whatever ``group``."""
        import torch.distributed as dist

        groups = _singleton_groups()
        return groups[dist.get_rank()]

    @classmethod
    def plain(cls, *, group: Any, device: torch.device) -> nn.Module:
        """The plain module on ``device``, its expert seeded by ``group.rank()``."""
        rank = _rank_of(group)
        with torch.random.fork_rng(devices=[]):
            model = cls(rank)
        return model.to(torch.device(device))

    @classmethod
    def build_fsdp(cls, *, group: Any, device: torch.device, fsdp_kwargs: Dict[str, Any]) -> nn.Module:
        """The 3-unit FSDP1 model (see the class docstring) of :meth:`ReferenceModel.build`, its expert seeded by
        ``group.rank()``, on ``device``."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        device = torch.device(device)
        model, kwargs = cls.plain(group=group, device=device), dict(fsdp_kwargs)
        expert_group = cls.expert_group(group)
        expert = quiet_construct(
            lambda: FSDP(model.module[2], process_group=expert_group, device_id=device, **kwargs),
            _NO_SHARD_WARNING,
        )
        for p in expert.parameters():  # the flat parameter when use_orig_params=False
            p.expert = True  # type: ignore[attr-defined]
        model.module[2] = expert
        model.module[1] = FSDP(model.module[1], process_group=group, device_id=device, **kwargs)
        return FSDP(model, process_group=group, device_id=device, **kwargs)

    @classmethod
    def apply_fully_shard(
        cls,
        model: "MixtureOfExperts",
        *,
        group: Any,
        device: torch.device,
        **fully_shard_kwargs: Any,
    ) -> "MixtureOfExperts":
        """FSDP2: ``fully_shard`` a plain build (``fsdp_kwargs=None``) in place:
        ``model.module[1]`` and the model over a 1-D mesh of ``group``,
        ``model.module[2]`` over a 1-D mesh of :meth:`expert_group`. Returns
        ``model``. Needs ``fully_shard`` and ``DeviceMesh.from_group``
        (``RuntimeError`` when this torch lacks them)."""
        fully_shard = _fully_shard_fn()
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # pragma: no cover - very old torch
            DeviceMesh = None  # type: ignore[assignment]
        if DeviceMesh is None or not hasattr(DeviceMesh, "from_group"):
            raise RuntimeError("this torch has no DeviceMesh.from_group")
        import torch.distributed as dist

        device_type = torch.device(device).type
        group = group if group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device_type=device_type)
        expert_mesh = DeviceMesh.from_group(cls.expert_group(group), device_type=device_type)
        fully_shard(model.module[1], mesh=mesh, **fully_shard_kwargs)
        fully_shard(model.module[2], mesh=expert_mesh, **fully_shard_kwargs)
        fully_shard(model, mesh=mesh, **fully_shard_kwargs)
        return model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        return (torch.rand(4, D_INPUT, generator=rank_generator(rank)).to(device),)


def _fully_shard_fn():
    """``fully_shard`` (``torch.distributed.fsdp`` from torch 2.6,
    ``torch.distributed._composable.fsdp`` in 2.4/2.5)."""
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard

        return fully_shard
    except ImportError:
        raise RuntimeError("this torch has no FSDP2 fully_shard") from None
