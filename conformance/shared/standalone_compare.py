"""A reproducer's comparison: each tensor of the hooked copy against native's, bit for bit, the first difference
named (parameter FQN, index, both values and their stored bits).

Written into a reproducer (:mod:`conformance.reproducers`) as far as its case uses it, and read by the rank
side too (the FQNs without wrappers, ``local``). Torch only.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

#: Prefixes FSDP (and activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")


def fqn_without_wrappers(name: str) -> str:
    """A parameter's FQN in the unwrapped model: FSDP's wrapper prefixes removed (FSDP1 and FSDP2)."""
    return _WRAPPER_PREFIXES.sub("", name)


def fqn_inside_ddp(name: str) -> str:
    """A parameter's FQN in the model DDP wraps: DDP's own leading ``module.`` removed (once)."""
    return name[len("module."):] if name.startswith("module.") else name


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of a DTensor (``to_local()``, FSDP2), else the tensor itself."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


#: The integer dtype of each floating dtype's width, to read its stored bits.
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(value: torch.Tensor) -> str:
    """The stored bits of a one-element floating tensor, in hex, as wide as its dtype."""
    size = value.element_size()
    return f"0x{int(value.reshape(1).view(_INTS[size])[0]) & ((1 << (8 * size)) - 1):0{2 * size}x}"


def _short(value: torch.Tensor) -> str:
    """The shortest decimal that reads back as ``value``'s bits in its own dtype (``-0.33552012``); NaN and
    infinities as ``repr``."""
    number = float(value)
    finite = number == number and abs(number) != float("inf")
    texts = (f"{number:.{digits}g}" for digits in range(1, 18) if finite)
    return next((t for t in texts if _bits(torch.tensor(float(t), dtype=value.dtype)) == _bits(value)), repr(number))


def first_difference(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> Optional[str]:
    """Why ``actual`` (hooked) is not bitwise equal to ``expected`` (native), or ``None``; NaN equals NaN,
    ``-0.0`` is not ``+0.0`` (the suite's ``compare_bitwise``)."""
    if actual is None or expected is None:
        hooked, native = ("None" if t is None else "set" for t in (actual, expected))
        return None if actual is expected else f"is {hooked} with the hook but {native} natively"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype != e.dtype or a.shape != e.shape:
        return (f"dtype {a.dtype} with the hook, {e.dtype} natively" if a.dtype != e.dtype else
                f"shape {tuple(a.shape)} with the hook, {tuple(e.shape)} natively")
    floating = a.is_floating_point()
    ints = _INTS.get(a.element_size())
    differ = ((a.view(ints) != e.view(ints)) & ~(torch.isnan(a) & torch.isnan(e))) if floating else a != e
    if not bool(differ.any()):
        return None
    flat = int(differ.reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    got, want = a.reshape(-1)[flat], e.reshape(-1)[flat]
    text = (f"got {_short(got)} ({_bits(got)}), but expected {_short(want)} ({_bits(want)})" if floating else
            f"got {got.item()!r}, but expected {want.item()!r}")
    return f"first difference at index {index}: {text}; {int(differ.sum())} of {a.numel()} elements differ"


def compare(what: str, hooked: Dict[str, Any], native: Dict[str, Any], rank: int, step: int) -> Optional[str]:
    """The first FQN (in ``native``'s order) whose tensor differs, as the line this rank prints, or ``None``."""
    for fqn, expected in native.items():
        why = first_difference(hooked.get(fqn), expected)
        if why is not None:
            return f"[rank {rank}, step {step}, parameter {fqn!r}] {what} differs from {reference()}: {why}"
    return None


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (an all-reduce over the default group: every rank stops together)."""
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
