"""How far a hook's verdict reaches: over the cases it passed, the longest training, the largest buffer, the
world sizes and the node layouts (plain data and standard library only).

A verdict holds for what was run, no further. Each case carries what its ranks measured
(:mod:`conformance.ranks.reach`: the training steps the hooked model lived through, the largest buffer the
hook was handed) and the node layout it ran under (:attr:`conformance.cases.CaseParams.nodes`). A hook's
:class:`Reach` is their extent over its passed cases; the terminal prints its :attr:`Reach.text` inside the
verdict's brackets (``CONFORMS  [412 cases: 400 passed, 12 skipped; up to 2000 steps, buffers up to 32 MiB,
1 and 2 nodes]``), and the JSON gives it per hook (``hooks[].reach``) and per case (``cases[].reach``), so a
gate can tell what a verdict covers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional, Tuple

__all__ = ["REACH_PROPERTIES", "Reach", "bytes_text", "hook_reach"]

#: The JUnit properties of a case's measured reach (:func:`conformance.controller.reach.note_reach`).
REACH_PROPERTIES = ("steps", "buffer_bytes")


def bytes_text(n: int) -> str:
    """``32 MiB``, ``1.5 MiB``, ``33 KiB``, ``96 bytes``: a buffer size for people (binary units)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            text = f"{n / size:.1f}"
            text = text[:-2] if text.endswith(".0") or n / size >= 10 else text
            return f"{text} {unit}"
    return f"{n} bytes"


def _and(items: Iterable[int]) -> str:
    words = [str(i) for i in sorted(set(items))]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


@dataclasses.dataclass(frozen=True)
class Reach:
    """The extent of a hook's passed cases.

    Attributes:
        cases: passed cases it is taken over.
        steps: the most training steps the hooked model lived through in one case (its state fresh at step 0).
        buffer_bytes: the largest buffer the API handed the hook in one call, in bytes.
        world_sizes: the world sizes of those cases.
        nodes: the node layouts' node counts (1: one node; 2: torchrun's variables for two nodes).
    """

    cases: int
    steps: int
    buffer_bytes: int
    world_sizes: Tuple[int, ...]
    nodes: Tuple[int, ...]

    @property
    def text(self) -> str:
        """``up to 2000 steps, buffers up to 32 MiB, 1 and 2 nodes``."""
        parts = []
        if self.steps:
            parts.append(f"up to {self.steps} step{'s' if self.steps != 1 else ''}")
        if self.buffer_bytes:
            parts.append(f"buffers up to {bytes_text(self.buffer_bytes)}")
        if self.nodes:
            parts.append(f"{_and(self.nodes)} node{'s' if self.nodes != (1,) else ''}")
        return ", ".join(parts)

    def to_json(self) -> Dict[str, Any]:
        return {"cases": self.cases, "max_steps": self.steps, "max_buffer_bytes": self.buffer_bytes,
                "world_sizes": list(self.world_sizes), "nodes": list(self.nodes)}


def hook_reach(records: Iterable[Any], hook: str) -> Optional[Reach]:
    """``hook``'s :class:`Reach` over its passed cases among ``records``
    (:class:`~conformance.reports.results.CaseRecord`), or ``None`` where it passed none."""
    passed = [r for r in records if r.hook == hook and r.outcome == "passed"]
    if not passed:
        return None
    reach = [r.reach or {} for r in passed]
    return Reach(cases=len(passed), steps=max(int(m.get("steps", 0)) for m in reach),
                 buffer_bytes=max(int(m.get("buffer_bytes", 0)) for m in reach),
                 world_sizes=tuple(sorted({r.world_size for r in passed if r.world_size})),
                 nodes=tuple(sorted({int(r.nodes or 1) for r in passed})))
