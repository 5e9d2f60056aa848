"""``SwitchProbe`` (``switch_probe_*``): a buffer past a hook's size switch, trained for as long as its other
switches need.

Real hooks combine their switches: PowerSGD compresses only after ``start_powerSGD_iter`` steps *and* only tensors
big enough to pay; "big buckets go bfloat16" turns on after a warm-up; a hierarchical all-reduce switches on the
node layout *and* the message size. The long runs train small models, ``large_probe`` trains two steps. A switch
probe is a model of one large parameter (``wide``) and one small (``head``), trained on the long run's
regression objective for hundreds of steps (:mod:`conformance.ranks.checks.long_run`): every step hands the hook
a buffer past the switch, so a path that needs both runs. Its ladder of sizes (:data:`SWITCH_PROBE_SIZES`) lets
a case pay for the buffer it needs, no more: the plan picks the smallest that reaches the hook's switch
(``HookSpec.switches``), and the nightly depth's own combination takes ``switch_probe_1m``, 4.25 MiB of float32.

``forward(g, h) = dot(wide, g) * 2**-k + dot(head, h)``, with ``2**-k`` about ``1 / numel``: the objective's
gradient, ``2 (output - target) * 2**-k * g``, keeps SGD on so large a dot product stable for thousands of steps
(unscaled, it overflows within ten). The inputs are uniform in [-1, 1) from the rank's generator, new every step
(``wide``'s a block of 65,521 such values, repeated).
Every length is odd and not a multiple of 3, so it is a multiple of no world size of 2 to 4 and of no power of
two: a dropped tail or an off-by-one chunk boundary shows.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple, Type

import torch
import torch.nn as nn

from conformance.models.base import ReferenceModel, rank_generator

__all__ = ["SWITCH_PROBES", "SWITCH_PROBE_SIZES", "SwitchProbe", "SwitchProbe1M", "SwitchProbe4M", "SwitchProbe64K",
           "SwitchProbe256K", "switch_probe_for"]

#: ``wide``'s elements per model, smallest first: ``2**k * 17 / 16 + 3`` (odd, not a multiple of 3), just past
#: 2**16, 2**18, 2**20 and 2**22 (17 MiB of float32; DDP's default bucket cap is 25 MiB).
SWITCH_PROBE_SIZES: Dict[str, int] = {"switch_probe_64k": 2**16 + 2**12 + 3, "switch_probe_256k": 2**18 + 2**14 + 3,
                                      "switch_probe_1m": 2**20 + 2**16 + 3, "switch_probe_4m": 2**22 + 2**18 + 3}
#: ``head``'s elements: small, odd, not a multiple of 3; the root FSDP unit's.
HEAD_NUMEL = 1001
#: Elements of the random block ``wide``'s input repeats: a prime, as the hard inputs' (``PLACED_PERIOD``).
INPUT_PERIOD = 65_521


class _Leaf(nn.Module):
    """One zero parameter; ``forward(g) = dot(weight, g) * scale``."""

    def __init__(self, numel: int, scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))
        self.scale = scale

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return torch.dot(self.weight, g) * self.scale


class SwitchProbe(ReferenceModel):
    """``loss`` over ``dot(wide, g) * 2**-k + dot(head, h)``: one parameter past a size switch (:data:`numel`
    elements, float32, zero) and a small one (:data:`HEAD_NUMEL`), in ``named_parameters()`` order ``wide.weight``,
    ``head.weight``.

    * DDP: ``wide`` alone fills a bucket past its switch (every size here is past DDP's 1 MiB first-bucket cap).
    * FSDP units: 2: ``FSDP(wide)`` (its flat parameter, and FSDP2's reduce-scatter input, of ``numel`` elements
      before padding) and the root (``head``); a replica or all-reduce hook on ``s`` shards gets ``numel / s``.
    * Input: ``(g, h)`` of the parameters' shapes, uniform in [-1, 1) from the rank's generator; output a 0-d
      tensor, which ``loss`` returns as is (the long run regresses it onto a random target instead).
    """

    name = "switch_probe"
    fsdp_units = 2
    numel = SWITCH_PROBE_SIZES["switch_probe_64k"]

    def __init__(self) -> None:
        super().__init__()
        scale = 2.0 ** -max(0, int(self.numel).bit_length() - 1)
        self.head = _Leaf(HEAD_NUMEL, 1.0)
        self.wide = _Leaf(self.numel, scale)

    @classmethod
    def input_shapes(cls) -> List[Tuple[int, ...]]:
        """Shapes of the inputs, in ``named_parameters()`` order of their parameters' FSDP units (``wide``,
        ``head``)."""
        return [(cls.numel,), (HEAD_NUMEL,)]

    @classmethod
    def _construct(cls, world_size: int) -> "SwitchProbe":
        return cls()

    def _wrap_nested(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        self.wide = wrap(self.wide)

    def forward(self, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.head(h) + self.wide(g)  # wide last: its gradient is ready first

    @classmethod
    def make_input(cls, rank: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        """``(g, h)``: ``h`` uniform in [-1, 1) from the rank's generator; ``g`` a block of :data:`INPUT_PERIOD`
        such values, repeated to ``numel`` (drawing millions of values a step cost more than the step's
        collectives; a prime period lines up with no power of two, no shard and no chunk of a hook)."""
        gen = rank_generator(rank)
        block = torch.rand(min(cls.numel, INPUT_PERIOD), generator=gen) * 2 - 1
        g = block.repeat(-(-cls.numel // block.numel()))[:cls.numel]
        h = torch.rand(HEAD_NUMEL, generator=gen) * 2 - 1
        return g.to(device), h.to(device)

    @classmethod
    def loss(cls, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output if output.dim() == 0 else output.sum()


class SwitchProbe64K(SwitchProbe):
    """A :class:`SwitchProbe` whose ``wide`` is just past 2**16 elements; FSDP units: 2 (``wide``, the
    root)."""

    name = "switch_probe_64k"
    numel = SWITCH_PROBE_SIZES["switch_probe_64k"]


class SwitchProbe256K(SwitchProbe):
    """A :class:`SwitchProbe` whose ``wide`` is just past 2**18 elements; FSDP units: 2 (``wide``, the
    root)."""

    name = "switch_probe_256k"
    numel = SWITCH_PROBE_SIZES["switch_probe_256k"]


class SwitchProbe1M(SwitchProbe):
    """A :class:`SwitchProbe` whose ``wide`` is just past 2**20 elements; FSDP units: 2 (``wide``, the
    root)."""

    name = "switch_probe_1m"
    numel = SWITCH_PROBE_SIZES["switch_probe_1m"]


class SwitchProbe4M(SwitchProbe):
    """A :class:`SwitchProbe` whose ``wide`` is just past 2**22 elements (17 MiB of float32); FSDP units: 2
    (``wide``, the root)."""

    name = "switch_probe_4m"
    numel = SWITCH_PROBE_SIZES["switch_probe_4m"]


#: The switch probes by name, smallest first.
SWITCH_PROBES: Dict[str, Type[SwitchProbe]] = {cls.name: cls for cls in (SwitchProbe64K, SwitchProbe256K,
                                                                          SwitchProbe1M, SwitchProbe4M)}


def switch_probe_for(elements: int) -> Tuple[str, bool]:
    """``(name, reached)``: the smallest switch probe whose ``wide`` has at least ``elements`` elements, with
    ``reached=True``; the largest, with ``reached=False``, where none has."""
    for name, numel in SWITCH_PROBE_SIZES.items():
        if numel >= elements:
            return name, True
    return list(SWITCH_PROBE_SIZES)[-1], False
