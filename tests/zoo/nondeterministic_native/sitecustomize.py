"""A machine whose native path is not bit-reproducible: put this folder on ``PYTHONPATH`` and every process of a
run imports it (Python's ``sitecustomize``).

It stands for what NCCL's NVLS kernels, an atomics-based GPU op or a reduction whose algorithm a library picks
per run do on real machines: every ``torch.nn.functional.linear`` output gets one element, chosen from the
operating system's randomness (not torch's seeded generator), moved by one ULP. The reference and the hooked
model alike then train to other bits on every run, whatever the hook is. A hook that is exact on the very
gradients it was handed must not be failed for it (the suite trains native twice, finds it irreproducible and
blames the machine); a hook whose own arithmetic is wrong still fails, its cause found from its own inputs.
``tests/test_not_the_hooks_fault.py`` runs the suite on it.
"""

import random

import torch
import torch.nn.functional as F

_linear = F.linear
_draw = random.SystemRandom()


def _nondeterministic_linear(input, weight, bias=None):
    out = _linear(input, weight, bias)
    if out.numel() and out.is_floating_point():
        out = out.clone()  # the gradient flows through as before; only the value moves
        flat = out.view(-1)
        i = _draw.randrange(flat.numel())
        with torch.no_grad():
            flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf"), dtype=out.dtype, device=out.device))
    return out


F.linear = _nondeterministic_linear
