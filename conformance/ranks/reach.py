"""How far a case reached on this rank: the training steps the hook under test lived through, and the largest
buffer it was handed (rank side, one meter per process).

A verdict must say how far it reaches (steps, buffer sizes, node layouts), measured from what the hook
actually saw, not from what a plan meant to run. Every API's recorder (the wrapper around the hook under
test) reports to this module's meter: :func:`saw_step` when a training step of the hooked model starts
(:meth:`conformance.ranks.checks.models.Recorder.begin_step`) and :func:`saw_buffer` on every call with the
buffer the API handed the hook (DDP's ``GradBucket.buffer()``, FSDP1's flat gradient, an FSDP2 comm's
``input_tensor``, an all-reduce hook's tensor). The worker starts a fresh meter for each case
(:func:`start`) and sends what it read (:func:`read`) with the case's outcome; the controller keeps the
largest over the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["read", "saw_buffer", "saw_bytes", "saw_step", "start"]

_METER: Dict[str, int] = {"steps": 0, "buffer_bytes": 0, "calls": 0}


def start() -> None:
    """A new case: nothing seen yet."""
    _METER.update(steps=0, buffer_bytes=0, calls=0)


def saw_step(step: int) -> None:
    """The hooked model starts training step ``step`` (0-based)."""
    _METER["steps"] = max(_METER["steps"], int(step) + 1)


def saw_buffer(tensor: Optional[torch.Tensor]) -> None:
    """The API handed the hook ``tensor`` (a ``torch.Tensor``; anything else is ignored)."""
    _METER["calls"] += 1
    try:
        size = int(tensor.numel()) * int(tensor.element_size())
    except (AttributeError, TypeError):
        return
    _METER["buffer_bytes"] = max(_METER["buffer_bytes"], size)


def saw_bytes(size: int) -> None:
    """The API handed the hook a buffer of ``size`` bytes, read where the suite cannot see the tensor (DDP's C++
    built-in hooks: the bucket sizes DDP logs)."""
    _METER["buffer_bytes"] = max(_METER["buffer_bytes"], int(size))


def read() -> Dict[str, int]:
    """``{"steps": training steps, "buffer_bytes": largest buffer in bytes, "calls": hook calls}`` since
    :func:`start`."""
    return dict(_METER)
