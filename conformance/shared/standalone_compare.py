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
    return t.to_local() if hasattr(t, "to_local") else t  # None has no to_local: None


def first_difference(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> Optional[str]:
    """Where ``got`` (hooked) first differs bit for bit from ``want`` (native), or ``None``; NaN equals NaN,
    ``-0.0`` is not ``+0.0`` (the suite's ``compare_bitwise``). Values are shown to 9 significant digits, with their
    stored bits in hex, as wide as the dtype (``0xbeabc949``)."""
    if got is None or want is None:
        return None if got is want else f"is {'set' if want is None else 'None'} with the hook, not natively"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"is {got.dtype} {tuple(got.shape)} with the hook, {want.dtype} {tuple(want.shape)} natively"
    g, w = (t.detach().cpu().reshape(-1, 1) for t in (got, want))  # an element a row: its bytes compared
    differ = (g.view(torch.uint8) != w.view(torch.uint8)).any(1) & ~(g.isnan() & w.isnan())[:, 0]
    if not bool(differ.any()):
        return None
    flat = int(differ.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
    a, b = g[flat], w[flat]
    bits = ["0x" + bytes(v.view(torch.uint8).tolist()[::-1]).hex() for v in (a, b)]  # stored little-endian, as torch
    return (f"first difference at index {index}: got {float(a):.9g} ({bits[0]}), but expected {float(b):.9g} "
            f"({bits[1]}); {int(differ.sum())} of {got.numel()} elements differ")

