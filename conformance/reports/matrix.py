"""One hook's pass/fail grid: check x variant (strategy or config) x world size.

A failing hook's cases are spread over many test ids; the grid puts them side
by side, so that a pattern such as "fails in every config except
``bucket_view``" (a DDP hook that reduces ``p.grad`` and returns the
unreduced bucket) shows at a glance. :func:`hook_matrix` builds the grid from
the case records (:class:`conformance.reports.results.CaseRecord`); the terminal
summary (:func:`matrix_text`), the Markdown summary (:func:`matrix_markdown`)
and the JSON (:meth:`HookMatrix.to_json`) render that one grid.

A cell holds every case of one check, variant and world size (the models, or
the registration rules, of that combination), and its outcome is the worst
among them: ``fail`` (a case failed or errored), ``xpass`` (a known failure
passed), ``xfail`` (known failures only), ``pass``, ``skip`` (skipped, with a
reason), ``not_run`` (collected, but the run stopped before it: ``-x``,
``--maxfail``, Ctrl-C). A cell of which some cases did not run says how many,
and the pattern never calls a variant or a world size clean on cases that did
not run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from conformance.reports.results import FAILING, CaseRecord

__all__ = ["Cell", "HookMatrix", "CELL_OUTCOMES", "NOT_RUN", "hook_matrix", "matrix_markdown", "matrix_text",
           "not_run_records", "pattern"]

#: The outcome of a :class:`~conformance.reports.results.CaseRecord` for a case collected but never run (a run
#: stopped early); such records feed the grid only, never the JSON ``cases``.
NOT_RUN = "not_run"
#: Cell outcomes, worst first: a cell takes the first that any of its cases has, so ``not_run`` only
#: where none of its cases ran.
CELL_OUTCOMES = ("fail", "xpass", "xfail", "pass", "skip", NOT_RUN)
_CELL_OF_CASE = {"failed": "fail", "error": "fail", "xpassed": "xpass", "xfailed": "xfail", "passed": "pass",
                 "skipped": "skip", NOT_RUN: NOT_RUN}

Key = Tuple[str, str, Optional[int]]


@dataclasses.dataclass(frozen=True)
class Cell:
    """The cases of one check, variant and world size.

    Attributes:
        outcome: one of :data:`CELL_OUTCOMES`, the worst of its cases that ran.
        cases: how many cases the cell holds (models or rules), run or not.
        failed: how many of them failed or errored.
        not_run: how many of them never ran (the run stopped first).
    """

    outcome: str
    cases: int
    failed: int
    not_run: int = 0

    def text(self) -> str:
        """``FAIL``, ``FAIL 2/5`` (failed of the cases that ran, where some passed), ``xpass``, ``xfail``,
        ``pass``, ``skip``, ``not run``; ``, N not run`` after it where only some of its cases ran."""
        if self.outcome == NOT_RUN:
            return "not run"
        ran = self.cases - self.not_run
        text = self.outcome
        if self.outcome == "fail":
            text = "FAIL" if self.failed == ran else f"FAIL {self.failed}/{ran}"
        return f"{text}, {self.not_run} not run" if self.not_run else text


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
                           "cases": cell.cases, "failed": cell.failed, "not_run": cell.not_run}
                          for (c, v, ws), cell in self.cells.items()]}

    @classmethod
    def from_json(cls, hook: str, data: Mapping[str, Any]) -> "HookMatrix":
        """The inverse of :meth:`to_json` (for rendering a results document; ``not_run`` is 0 where absent)."""
        cells = {(c["check"], c["variant"], c["world_size"]): Cell(c["outcome"], c["cases"], c["failed"],
                                                                   c.get("not_run", 0))
                 for c in data.get("cells", [])}
        return cls(hook=hook, variant_field=data.get("variant_field", "variant"), checks=tuple(data.get("checks", ())),
                   variants=tuple(data.get("variants", ())), world_sizes=tuple(data.get("world_sizes", ())),
                   cells=cells)


def hook_matrix(records: Sequence[CaseRecord], hook: str) -> HookMatrix:
    """The grid of ``hook``'s cases among ``records``.

    A record with no check or variant (a case that failed before the suite
    tagged it) is left out. A record whose outcome is :data:`NOT_RUN` is a case
    the run never reached.
    """
    mine = [r for r in records if r.hook == hook and r.check and r.variant]
    grouped: Dict[Key, List[CaseRecord]] = {}
    for r in mine:
        grouped.setdefault((r.check, r.variant, r.world_size), []).append(r)
    cells = {}
    for key, group in grouped.items():
        found = {_CELL_OF_CASE.get(r.outcome, "fail") for r in group}
        outcome = next(o for o in CELL_OUTCOMES if o in found)
        cells[key] = Cell(outcome, len(group), sum(r.outcome in FAILING for r in group),
                          sum(r.outcome == NOT_RUN for r in group))
    field = next((r.variant_field for r in mine if r.variant_field), "variant")
    return HookMatrix(
        hook=hook, variant_field=field,
        checks=tuple(dict.fromkeys(r.check for r in mine)),
        variants=tuple(dict.fromkeys(r.variant for r in mine)),
        world_sizes=tuple(sorted({r.world_size for r in mine}, key=lambda ws: (ws is None, ws or 0))),
        cells=cells)


def not_run_records(collected: Sequence[Tuple[str, Any]], records: Sequence[CaseRecord]) -> List[CaseRecord]:
    """A :data:`NOT_RUN` record for each collected ``(node id, CaseParams)`` that has no record among
    ``records`` (the run stopped before it), for :func:`hook_matrix`; its check is that of its suite test's
    other records, else the test's name without ``test_``."""
    ran = {r.id for r in records}
    checks = {r.name.split("[", 1)[0]: r.check for r in records if r.check}
    out = []
    for nodeid, case in collected:
        if nodeid in ran or case is None:
            continue
        name = nodeid.rsplit("::", 1)[-1]
        test = name.split("[", 1)[0]
        out.append(CaseRecord(id=nodeid, name=name, outcome=NOT_RUN, hook=case.hook, api=case.api,
                              check=checks.get(test) or test[len("test_"):], variant=case.variant,
                              variant_field=case.variant_field, model=case.model, rule=case.rule,
                              world_size=case.world_size))
    return out


def _join(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def pattern(m: HookMatrix) -> str:
    """Where the hook fails, in one phrase, or ``""`` when no cell failed.

    ``fails in every config except bucket_view``, ``fails only in strategy NO_SHARD``,
    ``..., only at world size 3``. A variant counts as clean where it passed at
    least once and never failed; known failures and skips count as neither.
    Where cases did not run (a stopped run), the phrase claims nothing about
    them: no "every", "only" or "except" rests on a variant or world size with a
    case not run, and it closes with how many cases did not run.
    """
    def outcomes(select) -> set:
        return {cell.outcome for key, cell in m.cells.items() if select(key)}

    def unknown(select) -> bool:
        return any(cell.not_run for key, cell in m.cells.items() if select(key))

    failing_v = [v for v in m.variants if "fail" in outcomes(lambda k: k[1] == v)]
    if not failing_v:
        return ""
    unknown_v = [v for v in m.variants if v not in failing_v and unknown(lambda k: k[1] == v)]
    clean_v = [v for v in m.variants if v not in failing_v and v not in unknown_v
               and "pass" in outcomes(lambda k: k[1] == v)]
    field = m.variant_field
    if unknown_v:
        text = f"fails in {field} {_join(failing_v)}"
    elif not clean_v:
        text = f"fails in every {field}" if len(failing_v) > 1 else f"fails in {field} {failing_v[0]}"
    elif len(clean_v) <= len(failing_v):
        text = f"fails in every {field} except {_join(clean_v)}"
    else:
        text = f"fails only in {field} {_join(failing_v)}"
    ran_ws = [ws for ws in m.world_sizes if outcomes(lambda k: k[2] == ws) - {"skip", NOT_RUN}]
    failing_ws = [ws for ws in ran_ws if "fail" in outcomes(lambda k: k[2] == ws)]
    unsure_ws = [ws for ws in m.world_sizes if ws not in failing_ws and unknown(lambda k: k[2] == ws)]
    if len(ran_ws) > 1 or unsure_ws:
        if unsure_ws:
            text += f", at world size {_join(failing_ws)}"
        elif len(failing_ws) < len(ran_ws):
            text += f", only at world size {_join(failing_ws)}"
        else:
            text += f", at world sizes {_join(ran_ws)}"
    not_run = sum(cell.not_run for cell in m.cells.values())
    if not_run:
        text += f" ({not_run} case{'s' if not_run > 1 else ''} not run, which may fail too)"
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
