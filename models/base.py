"""The reference-model contract: :class:`ReferenceModel` and shared helpers.

Every reference model is an ``nn.Module`` subclass with three classmethods the
checks rely on:

* ``build(group=..., device=..., fsdp_kwargs=...)``: a freshly constructed,
  deterministic model on ``device``. ``fsdp_kwargs=None`` gives the plain,
  unwrapped module (``plain(group=..., device=...)``: the DDP / FSDP2 / single-process
  starting point); a dict gives a root
  ``FullyShardedDataParallel`` instance with the model's nested FSDP units,
  every unit constructed with ``process_group=group``, ``device_id=device``
  and ``**fsdp_kwargs``.
* ``make_input(rank, world_size, device)``: deterministic, rank-dependent
  inputs (a tuple, passed as ``model(*inputs)``). A local
  ``torch.Generator`` seeded with ``1 + rank`` is used, so the global RNG is
  neither read nor changed.
* ``loss(inputs, output)``: a scalar loss.

Parameters are always created on CPU under ``torch.manual_seed(0)`` inside
``torch.random.fork_rng`` (CPU state only), so every construction on every
rank and every device type starts from bit-identical values, and building a
model leaves the caller's global RNG state untouched. Nested FSDP units are
applied *after* construction, so the wrapped and unwrapped builds of one model
hold the same initial values.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple

import torch
import torch.nn as nn

__all__ = [
    "ReferenceModel",
    "quiet_construct",
    "rank_generator",
    "world_size_of",
]

#: Keys the models set themselves on every FSDP unit; a caller must not pass them.
_RESERVED_FSDP_KWARGS = ("module", "process_group", "device_id")


def rank_generator(rank: int) -> torch.Generator:
    """A CPU generator seeded with ``1 + rank`` (the seeds' ``manual_seed(1 + rank)``)."""
    return torch.Generator(device="cpu").manual_seed(1 + rank)


def world_size_of(group: Any) -> int:
    """``group.size()``; ``None`` means the default process group.

    Raises:
        ValueError: ``group`` is ``None`` and no default process group is initialized.
    """
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group=None needs an initialized default process group to know the world size")
    return int(group.size()) if group is not None else dist.get_world_size()


class ReferenceModel(nn.Module):
    """Base class of the reference models. Subclasses set :attr:`name` and
    implement :meth:`_construct` (and, when they have nested FSDP units,
    :meth:`_wrap_nested`), :meth:`make_input` and optionally :meth:`loss`."""

    #: Registry key (``models.MODELS[name]``).
    name: ClassVar[str]
    #: Number of FSDP units (``FullyShardedDataParallel.fsdp_modules(root)``,
    #: root included) that ``build`` gives with no ``auto_wrap_policy`` or
    #: ``mixed_precision`` in ``fsdp_kwargs``.
    fsdp_units: ClassVar[int]
    #: The most steps a parity check trains this model, or ``None`` (the check's own count): a model of
    #: production-sized buffers trains the steps where they change shape (DDP builds its buckets in the first
    #: step and rebuilds them for the second), no more.
    max_steps: ClassVar[Optional[int]] = None

    # -- construction ------------------------------------------------------
    @classmethod
    def _construct(cls, world_size: int) -> "ReferenceModel":
        """Create the unwrapped model on CPU. Called under ``manual_seed(0)``."""
        raise NotImplementedError

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Replace the submodules the mirrored PyTorch model wraps in nested
        FSDP units by ``wrap(submodule)``, innermost first. Default: none."""

    @classmethod
    def _root_fsdp_kwargs(cls, fsdp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Extra keyword arguments of the root FSDP call only (for example an
        ``auto_wrap_policy``). ``fsdp_kwargs`` is a private copy; pop from it
        what the root call takes over."""
        return {}

    @classmethod
    def plain(cls, *, group: Any, device: torch.device) -> nn.Module:
        """The plain, unwrapped module on ``device``: what ``build(fsdp_kwargs=None)`` gives (DDP's and FSDP2's
        starting point, the single-process reference). A model that does more to its plain module (freezing,
        per-rank seeds) overrides this and ``build`` alike."""
        return cls._seeded(group, device)

    @classmethod
    def _seeded(cls, group: Any, device: torch.device) -> nn.Module:
        """``_construct`` under ``torch.manual_seed(0)`` (CPU state forked), moved to ``device``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = cls._construct(cls._world_size(group))
        return model.to(torch.device(device))

    @classmethod
    def build(cls, *, group: Any, device: torch.device, fsdp_kwargs: Optional[Dict[str, Any]]) -> nn.Module:
        """Construct the model deterministically and move it to ``device``.

        ``fsdp_kwargs=None``: the plain module (:meth:`plain`). Otherwise a root
        ``FullyShardedDataParallel`` (with the nested units of the mirrored
        PyTorch test model): :meth:`build_fsdp` with a checked copy of ``fsdp_kwargs``.

        Raises:
            TypeError: ``fsdp_kwargs`` sets ``module``, ``process_group`` or ``device_id``, which the build sets.
        """
        if fsdp_kwargs is None:
            return cls.plain(group=group, device=device)
        return cls.build_fsdp(group=group, device=device, fsdp_kwargs=checked_fsdp_kwargs(cls.__name__, fsdp_kwargs))

    @classmethod
    def build_fsdp(cls, *, group: Any, device: torch.device, fsdp_kwargs: Dict[str, Any]) -> nn.Module:
        """The root ``FullyShardedDataParallel`` of :meth:`build`: every FSDP unit (the nested ones of
        :meth:`_wrap_nested`, innermost first, then the root with :meth:`_root_fsdp_kwargs`) gets
        ``process_group=group``, ``device_id=device`` and ``**fsdp_kwargs`` (checked by :meth:`build`; an FSDP1
        reproducer, whose keywords are the suite's, calls this directly). ``fsdp_kwargs`` is the caller's own dict
        (:meth:`build`'s checked copy, the reproducer's literal): the root's keywords are popped from it."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = cls._seeded(group, device)
        root_extra = cls._root_fsdp_kwargs(fsdp_kwargs)  # popped before the units' keywords are bound below
        wrap = functools.partial(FSDP, process_group=group, device_id=torch.device(device), **fsdp_kwargs)
        model._wrap_nested(wrap)
        return wrap(model, **root_extra)

    @classmethod
    def _world_size(cls, group: Any) -> int:
        """The world size :meth:`_construct` gets: 1 here (the model is the same at every world size); a model
        whose shape depends on it returns :func:`world_size_of` ``(group)``."""
        return 1

    # -- data ----------------------------------------------------------------
    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @classmethod
    def loss(cls, inputs: tuple, output: Any) -> torch.Tensor:
        """``output.sum()`` (the seeds' loss); a 0-d output is returned as is."""
        return output if output.dim() == 0 else output.sum()


def quiet_construct(fn: Callable[[], nn.Module], *messages: str) -> nn.Module:
    """Call ``fn()`` with the ``UserWarning`` messages (regex prefixes) silenced."""
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        return fn()


def checked_fsdp_kwargs(model_name: str, fsdp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of ``fsdp_kwargs``; ``TypeError`` if it sets what ``build`` sets itself."""
    bad = sorted(k for k in _RESERVED_FSDP_KWARGS if k in fsdp_kwargs)
    if bad:
        raise TypeError(f"{model_name}.build sets {', '.join(bad)} itself; pass group= and device= instead of "
                        "putting them in fsdp_kwargs")
    return dict(fsdp_kwargs)
