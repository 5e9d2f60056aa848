"""A reproducer's comparison: each tensor of the hooked copy against native's, bit for bit, the first difference
named (parameter FQN, index, both values and their stored bits in hex).

Written into a reproducer (:mod:`conformance.reproducers`) as far as its case uses it, and read by the rank
side too (the FQNs without wrappers, ``local``). Torch only.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

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


#: The integer dtype of each element width: a tensor viewed as it reads its stored bits.
INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def hex_bits(value: torch.Tensor) -> str:
    """The stored bits of a one-element tensor in hex, as wide as its dtype (``0xbeabc949``)."""
    size = value.element_size()
    return f"0x{int(value.view(INTS[size])) & ((1 << 8 * size) - 1):0{2 * size}x}"


def first_difference(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> Optional[str]:
    """Where ``got`` (hooked) first differs bit for bit from ``want`` (native), or ``None``; NaN equals NaN,
    ``-0.0`` is not ``+0.0`` (the suite's ``compare_bitwise``). Values are shown to 9 significant digits."""
    if got is None or want is None:
        return None if got is want else f"is {'set' if want is None else 'None'} with the hook, not natively"
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"is {got.dtype} {tuple(got.shape)} with the hook, {want.dtype} {tuple(want.shape)} natively"
    g, w, ints = got.reshape(-1), want.reshape(-1), INTS[got.element_size()]
    differ = (g.view(ints) != w.view(ints)) & ~(g.isnan() & w.isnan())
    if not bool(differ.any()):
        return None
    flat = int(differ.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
    a, b = g[flat], w[flat]
    return (f"first difference at index {index}: got {float(a):.9g} ({hex_bits(a)}), but expected {float(b):.9g} "
            f"({hex_bits(b)}); {int(differ.sum())} of {got.numel()} elements differ")

