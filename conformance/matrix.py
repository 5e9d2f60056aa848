"""One hook's pass/fail grid: check x variant (strategy or config) x world size.

A failing hook's cases are spread over many test ids; the grid puts them side
by side, so that a pattern such as "fails in every config except
``bucket_view``" (a DDP hook that reduces ``p.grad`` and returns the
unreduced bucket) shows at a glance. :func:`hook_matrix` builds the grid from
the case records (:class:`conformance.results.CaseRecord`); the terminal
summary (:func:`matrix_text`), the Markdown summary (:func:`matrix_markdown`)
and the JSON (:meth:`HookMatrix.to_json`) render that one grid.

A cell holds every case of one check, variant and world size (the models, or
the registration rules, of that combination), and its outcome is the worst
among them: ``fail`` (a case failed or errored), ``xpass`` (a known failure
passed), ``xfail`` (known failures only), ``pass``, ``skip`` (nothing ran).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from conformance.results import FAILING, CaseRecord

__all__ = ["Cell", "HookMatrix", "CELL_OUTCOMES", "hook_matrix", "matrix_markdown", "matrix_text", "pattern"]

#: Cell outcomes, worst first: a cell takes the first that any of its cases has.
CELL_OUTCOMES = ("fail", "xpass", "xfail", "pass", "skip")
_CELL_OF_CASE = {"failed": "fail", "error": "fail", "xpassed": "xpass", "xfailed": "xfail", "passed": "pass",
                 "skipped": "skip"}

Key = Tuple[str, str, Optional[int]]


@dataclasses.dataclass(frozen=True)
class Cell:
    """The cases of one check, variant and world size.

    Attributes:
        outcome: one of :data:`CELL_OUTCOMES`, the worst of its cases.
        cases: how many cases the cell holds (models or rules).
        failed: how many of them failed or errored.
    """

    outcome: str
    cases: int
    failed: int

    def text(self) -> str:
        """``FAIL``, ``FAIL 2/5`` (failed of cases, where some passed), ``xpass``, ``xfail``, ``pass``, ``skip``."""
        if self.outcome == "fail":
            return "FAIL" if self.failed == self.cases else f"FAIL {self.failed}/{self.cases}"
        return self.outcome


@dataclasses.dataclass(frozen=True)
class HookMatrix:
    """One hook's grid.

    Attributes:
        hook: the spec's name.
        variant_field: what the variants are: ``"strategy"`` (fsdp) or ``"config"`` (ddp, fsdp2).
        checks: the rows' checks, in the order the cases ran.
        variants: the columns, in the order the cases ran.
        world_sizes: ascending.
        cells: ``(check, variant, world_size) -> Cell``; a combination with no case has no cell.
    """

    hook: str
    variant_field: str
    checks: Tuple[str, ...]
    variants: Tuple[str, ...]
    world_sizes: Tuple[Optional[int], ...]
    cells: Dict[Key, Cell]

    def rows(self) -> List[Tuple[str, Optional[int]]]:
        """``(check, world_size)`` of every row that has a cell, checks in order, then world sizes."""
        return [(check, ws) for check in self.checks for ws in self.world_sizes
                if any((check, v, ws) in self.cells for v in self.variants)]

    def to_json(self) -> Dict[str, Any]:
        """The grid as the JSON ``matrix`` of a hook: the axes, then one entry per cell."""
        return {"variant_field": self.variant_field, "checks": list(self.checks), "variants": list(self.variants),
                "world_sizes": list(self.world_sizes), "pattern": pattern(self),
                "cells": [{"check": c, "variant": v, "world_size": ws, "outcome": cell.outcome,
                           "cases": cell.cases, "failed": cell.failed}
                          for (c, v, ws), cell in self.cells.items()]}


def hook_matrix(records: Sequence[CaseRecord], hook: str) -> HookMatrix:
    """The grid of ``hook``'s cases among ``records``.

    A record with no check or variant (a case that failed before the suite
    tagged it) is left out.
    """
    mine = [r for r in records if r.hook == hook and r.check and r.variant]
    grouped: Dict[Key, List[CaseRecord]] = {}
    for r in mine:
        grouped.setdefault((r.check, r.variant, r.world_size), []).append(r)
    cells = {}
    for key, group in grouped.items():
        found = {_CELL_OF_CASE.get(r.outcome, "fail") for r in group}
        outcome = next(o for o in CELL_OUTCOMES if o in found)
        cells[key] = Cell(outcome, len(group), sum(r.outcome in FAILING for r in group))
    field = next((r.variant_field for r in mine if r.variant_field), "variant")
    return HookMatrix(
        hook=hook, variant_field=field,
        checks=tuple(dict.fromkeys(r.check for r in mine)),
        variants=tuple(dict.fromkeys(r.variant for r in mine)),
        world_sizes=tuple(sorted({r.world_size for r in mine}, key=lambda ws: (ws is None, ws or 0))),
        cells=cells)


def _join(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def pattern(m: HookMatrix) -> str:
    """Where the hook fails, in one phrase, or ``""`` when no cell failed.

    ``fails in every config except bucket_view``, ``fails only in strategy NO_SHARD``,
    ``..., only at world size 3``. A variant counts as clean where it passed at
    least once and never failed; known failures and skips count as neither.
    """
    def outcomes(select) -> set:
        return {cell.outcome for key, cell in m.cells.items() if select(key)}

    failing_v = [v for v in m.variants if "fail" in outcomes(lambda k: k[1] == v)]
    if not failing_v:
        return ""
    clean_v = [v for v in m.variants if v not in failing_v and "pass" in outcomes(lambda k: k[1] == v)]
    field = m.variant_field
    if not clean_v:
        text = f"fails in every {field}" if len(failing_v) > 1 else f"fails in {field} {failing_v[0]}"
    elif len(clean_v) <= len(failing_v):
        text = f"fails in every {field} except {_join(clean_v)}"
    else:
        text = f"fails only in {field} {_join(failing_v)}"
    ran_ws = [ws for ws in m.world_sizes if outcomes(lambda k: k[2] == ws) - {"skip"}]
    failing_ws = [ws for ws in ran_ws if "fail" in outcomes(lambda k: k[2] == ws)]
    if len(ran_ws) > 1:
        if len(failing_ws) < len(ran_ws):
            text += f", only at world size {_join(failing_ws)}"
        else:
            text += f", at world sizes {_join(ran_ws)}"
    return text


def _ws(ws: Optional[int]) -> str:
    return "-" if ws is None else str(ws)


def matrix_text(m: HookMatrix, indent: str = "  ") -> List[str]:
    """The grid for the terminal: the pattern (where there is one), then a header, then a row per check and
    world size, a column per variant."""
    rows = m.rows()
    if not rows:
        return []
    check_w = max(len("check"), *(len(c) for c, _ in rows))
    ws_w = max(len("ws"), *(len(_ws(ws)) for _, ws in rows))
    widths = [max(len(v), *(len(m.cells[(c, v, ws)].text()) for c, ws in rows if (c, v, ws) in m.cells))
              for v in m.variants]
    what = pattern(m)
    lines = [f"{indent}{what}:"] if what else []
    lines.append(indent + f"{'check':<{check_w}}  {'ws':>{ws_w}}  " + "  ".join(
        f"{v:<{w}}" for v, w in zip(m.variants, widths)).rstrip())
    for check, ws in rows:
        cells = [(m.cells[(check, v, ws)].text() if (check, v, ws) in m.cells else "-") for v in m.variants]
        lines.append(indent + f"{check:<{check_w}}  {_ws(ws):>{ws_w}}  " + "  ".join(
            f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip())
    return lines


def matrix_markdown(m: HookMatrix) -> str:
    """The grid as a Markdown table (a failing cell in bold), under its pattern."""
    rows = m.rows()
    if not rows:
        return ""
    out = []
    what = pattern(m)
    if what:
        out += [f"Pattern: {what}.", ""]
    out.append(f"| check | world size | {' | '.join(f'`{v}`' for v in m.variants)} |")
    out.append("| --- | --- |" + " --- |" * len(m.variants))
    for check, ws in rows:
        cells = []
        for v in m.variants:
            cell = m.cells.get((check, v, ws))
            cells.append("–" if cell is None else (f"**{cell.text()}**" if cell.outcome == "fail" else cell.text()))
        out.append(f"| {check} | {_ws(ws)} | {' | '.join(cells)} |")
    return "\n".join(out)
