"""How far a hook's verdict reaches: over the cases it passed, what ran together (training steps, buffer size,
node layout), the world sizes and the backends (plain data and standard library only).

A verdict holds for what was run, no further. Each case carries what its ranks measured
(:mod:`conformance.ranks.reach`: the training steps the hooked model lived through, the largest buffer the
hook was handed) and the node layout it ran under (:attr:`conformance.cases.CaseParams.nodes`). A hook's
:class:`Reach` is their extent over its passed cases, as the combinations that ran together: the maxima of each
axis alone would read as if 256 steps, 29 MiB and 2 nodes had run in one case, where no case ran two of them.
The terminal prints its :attr:`Reach.text` inside the verdict's brackets (``CONFORMS  [44 cases: 44 passed; 256
steps on buffers up to 33 KiB; 2 steps on buffers up to 29 MiB; 4 steps on buffers up to 33 KiB on 2 simulated
nodes; world sizes 2, 3 and 4; gloo]``), and the JSON gives it per hook (``hooks[].reach``) and per case
(``cases[].reach``), so a gate can tell what a verdict covers.

A case's own figures travel as JUnit properties: :func:`note_reach` turns its ranks' measurements into the case's
``steps`` and ``buffer_bytes`` properties (:data:`REACH_PROPERTIES`), which the bookkeeper keeps per case and, over
the cases a hook passed, per hook (:mod:`conformance.reports.bookkeeper`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, Optional, Sequence, Tuple

from conformance.protocol import CaseResult
from conformance.reports.cost import COST_PROPERTY, combine_ranks

if TYPE_CHECKING:  # pragma: no cover
    import pytest

    from conformance.controller.pytest_plugin import SessionState

__all__ = ["REACH_PROPERTIES", "Reach", "bytes_text", "combinations", "hook_reach", "not_checked", "not_checked_lines",
           "note_reach", "reach_context", "reach_from_json", "short_reason"]

#: The JUnit properties of a case's measured reach (:func:`note_reach`).
REACH_PROPERTIES = ("steps", "buffer_bytes")


def note_reach(request: pytest.FixtureRequest, result: CaseResult, real_nodes: Optional[int] = None) -> None:
    """Give the test the reach its ranks measured as JUnit properties: for each of :data:`REACH_PROPERTIES`,
    the largest over the ranks and over the case's dispatches so far (a hard-input case sends several), where
    the hook was called at all. ``real_nodes``: the nodes torchrun spread the ranks over (``--listen``,
    :attr:`conformance.controller.remote.RemotePool.nodes`), which replace the case's own ``nodes``. The cost of a
    training step its ranks measured (:mod:`conformance.ranks.cost`) becomes its ``cost`` property, once."""
    props = request.node.user_properties
    held = dict(props)
    if real_nodes is not None and real_nodes != held.get("nodes"):
        props.append(("nodes", real_nodes))
    for key in REACH_PROPERTIES:
        value = max([int(o.reach.get(key, 0)) for o in result.outcomes if o.reach] + [int(held.get(key) or 0)])
        if value and value != held.get(key):
            props.append((key, value))
    cost = combine_ranks(o.cost for o in result.outcomes if o.ok)
    if cost and COST_PROPERTY not in held:  # a case of several dispatches (hard inputs) keeps its first step's
        props.append((COST_PROPERTY, json.dumps(cost, sort_keys=True, separators=(",", ":"))))


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


#: The combinations a verdict line names (the JSON has them all): the longest training first.
SHOWN_COMBINATIONS = 4


@dataclasses.dataclass(frozen=True)
class Reach:
    """The extent of a hook's passed cases, and what of it ran together.

    Attributes:
        cases: passed cases it is taken over.
        steps: the most training steps the hooked model lived through in one case (its state fresh at step 0).
        buffer_bytes: the largest buffer the API handed the hook in one call, in bytes.
        world_sizes: the world sizes of those cases.
        nodes: the node layouts' node counts (1: one node; 2: torchrun's variables for two nodes).
        combinations: ``(steps, buffer_bytes, nodes)`` of the cases no other passed case exceeds on all three at
            once, the longest first: what ran together (256 steps on small buffers, 29 MiB for 2 steps, 2 nodes
            on small buffers), where the maxima alone would read as if they had.
        backends: the process group backends its cases ran on.
        simulated_nodes: the node layouts were simulated with torchrun's variables on one machine (``False``
            under ``--listen``, where torchrun's ranks are on their real nodes).
    """

    cases: int
    steps: int
    buffer_bytes: int
    world_sizes: Tuple[int, ...]
    nodes: Tuple[int, ...]
    combinations: Tuple[Tuple[int, int, int], ...] = ()
    backends: Tuple[str, ...] = ()
    simulated_nodes: bool = True

    @staticmethod
    def _combination_text(steps: int, size: int, nodes: int, simulated: bool) -> str:
        parts = [f"{steps} step{'s' if steps != 1 else ''}" if steps else "no training"]
        if size:
            parts.append(f"on buffers up to {bytes_text(size)}")
        if nodes > 1:
            parts.append(f"on {nodes} {'simulated ' if simulated else ''}nodes")
        return " ".join(parts)

    @property
    def text(self) -> str:
        """``256 steps on buffers up to 33 KiB; 2 steps on buffers up to 29 MiB; 4 steps on buffers up to 33 KiB on 2
        simulated nodes; world sizes 2, 3 and 4; gloo``: what ran together, then where."""
        combos = [self._combination_text(*c, self.simulated_nodes) for c in self.combinations[:SHOWN_COMBINATIONS]]
        if len(self.combinations) > SHOWN_COMBINATIONS:
            combos.append(f"{len(self.combinations) - SHOWN_COMBINATIONS} more combination(s) in the JSON")
        if not self.combinations and self.nodes:
            combos.append(f"{_and(self.nodes)} node{'s' if self.nodes != (1,) else ''}")
        if self.world_sizes:
            sizes = self.world_sizes
            combos.append(f"world size{'s' if len(sizes) > 1 else ''} {_and(sizes)}")
        if self.backends:
            combos.append(" and ".join(self.backends))
        return "; ".join(combos)

    def to_json(self) -> Dict[str, Any]:
        return {"cases": self.cases, "max_steps": self.steps, "max_buffer_bytes": self.buffer_bytes,
                "world_sizes": list(self.world_sizes), "nodes": list(self.nodes),
                "combinations": [{"steps": s, "buffer_bytes": b, "nodes": n} for s, b, n in self.combinations],
                "backends": list(self.backends), "simulated_nodes": self.simulated_nodes}


def reach_from_json(data: Dict[str, Any]) -> Reach:
    """A :class:`Reach` from its JSON (``hooks[].reach``; a file of schema 1.7 to 1.9 has no combinations)."""
    return Reach(cases=int(data.get("cases", 0)), steps=int(data.get("max_steps", 0)),
                 buffer_bytes=int(data.get("max_buffer_bytes", 0)), world_sizes=tuple(data.get("world_sizes", ())),
                 nodes=tuple(data.get("nodes", ())),
                 combinations=tuple((int(c["steps"]), int(c["buffer_bytes"]), int(c["nodes"]))
                                    for c in data.get("combinations", ())),
                 backends=tuple(data.get("backends", ())), simulated_nodes=bool(data.get("simulated_nodes", True)))


def combinations(points: Iterable[Tuple[int, int, int]]) -> Tuple[Tuple[int, int, int], ...]:
    """The points no other point reaches or exceeds on all three axes (the Pareto front), the longest first."""
    unique = set(points)
    front = [p for p in unique if not any(q != p and all(a >= b for a, b in zip(q, p)) for q in unique)]
    return tuple(sorted(front, key=lambda p: (-p[0], -p[1], -p[2])))


def hook_reach(records: Iterable[Any], hook: str, backends: Sequence[str] = (),
               simulated_nodes: bool = True) -> Optional[Reach]:
    """``hook``'s :class:`Reach` over its passed cases among ``records``
    (:class:`~conformance.reports.results.CaseRecord`), or ``None`` where it passed none. ``backends``: the
    backends of the run's pools; ``simulated_nodes``: the node layouts were simulated (not ``--listen``)."""
    passed = [r for r in records if r.hook == hook and r.outcome == "passed"]
    if not passed:
        return None
    reach = [r.reach or {} for r in passed]
    points = [(int(m.get("steps", 0)), int(m.get("buffer_bytes", 0)), int(r.nodes or 1)) for r, m in zip(passed, reach)]
    trained = [p for p in points if p[0] or p[1]]
    return Reach(cases=len(passed), steps=max(int(m.get("steps", 0)) for m in reach),
                 buffer_bytes=max(int(m.get("buffer_bytes", 0)) for m in reach),
                 world_sizes=tuple(sorted({r.world_size for r in passed if r.world_size})),
                 nodes=tuple(sorted({int(r.nodes or 1) for r in passed})), combinations=combinations(trained),
                 backends=tuple(sorted(set(backends))), simulated_nodes=simulated_nodes)


def reach_context(state: SessionState) -> Tuple[Tuple[str, ...], bool]:
    """``(backends, simulated_nodes)`` of a session (``state``: the controller's session state): the backend of
    each world size's pool, and whether its node layouts are simulated (not ``--listen``)."""
    settings = getattr(state, "settings", None)
    if settings is None:
        return (), True
    sizes = sorted(getattr(state, "world_sizes", None) or settings.world_sizes)
    return tuple(sorted({settings.placement(ws)[0] for ws in sizes})), getattr(settings, "listen", None) is None


#: Items a "not checked here" line names per reason (the JSON has them all).
SHOWN_NOT_CHECKED = 4


def not_checked(records: Iterable[Any], hook: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """What of ``hook``'s plan could not run here, and why: per skip reason (the most cases first), the cases it
    skipped as ``check[variant]`` (with their model where two of one check and variant differ), each once. A
    verdict names them, so that a user of, say, ``set_gradient_divide_factor`` reads that those configs were not
    checked here, not only that some cases were skipped."""
    by_reason: Dict[str, Dict[str, None]] = {}
    skipped = [r for r in records if r.hook == hook and r.outcome == "skipped"]
    models: Dict[Tuple[str, str], set] = {}
    for r in skipped:
        models.setdefault((r.check or "?", r.variant or "?"), set()).add(r.model or r.rule or "")
    for r in skipped:
        why = r.skip_reason or ""
        if why.startswith(("not needed:", "NOT RUN")) or why.endswith(".NotRun"):
            continue  # a combined case the hook's code did not call for; the run's own failure (its verdict says)
        key = (r.check or "?", r.variant or "?")
        item = f"{key[0]}[{key[1]}" + (f", {r.model or r.rule}]" if len(models[key]) > 1 else "]")
        by_reason.setdefault((r.skip_reason or "no reason given").strip(), {})[item] = None
    return tuple(sorted(((reason, tuple(items)) for reason, items in by_reason.items()),
                        key=lambda x: (-len(x[1]), x[0])))


def short_reason(reason: str) -> str:
    """A skip reason's gist for a verdict line: its parentheses left out, up to its first colon or semicolon."""
    text = reason
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", text)
        if shorter == text:
            break
        text = shorter
    for stop in (": ", "; "):
        text = text.split(stop, 1)[0]
    return text.strip().rstrip(".") or reason


def not_checked_lines(records: Iterable[Any], hook: str) -> Iterator[str]:
    """``not checked here: fsdp2_parity[divide_factor], ... (gloo has no ReduceOp.PREMUL_SUM)``, a line per reason."""
    for reason, items in not_checked(records, hook):
        shown = ", ".join(items[:SHOWN_NOT_CHECKED])
        more = f" and {len(items) - SHOWN_NOT_CHECKED} more" if len(items) > SHOWN_NOT_CHECKED else ""
        yield f"not checked here: {shown}{more} ({short_reason(reason)})"
