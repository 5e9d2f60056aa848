"""A hook's cost against native's: collectives, bytes on the wire and (on a GPU) time per training step (plain data
and standard library only).

Each rank measures one training step of the hooked model and of native's, in the same case on the same inputs
(:mod:`conformance.ranks.cost`, PyTorch's flight recorder); :func:`combine_ranks` makes a case's figures from its
ranks' (the mean per rank), carried as the case's ``cost`` JUnit property and its ``cases[].cost`` in the JSON.
:func:`hook_cost` sums a hook's cases into a :class:`Cost`: the ratios of its figures to native's over the same
cases, which the verdict block prints (``cost vs native: 1.0x collectives, 0.50x bytes (float16 on the wire)``),
the JSON gives as ``hooks[].cost``, ``--max-cost`` gates (:func:`over_max`) and a baseline remembers
(:func:`cost_regressions`). Time is a ratio only where the ranks timed the step with CUDA events: on CPU, gloo's
loopback says nothing of what NCCL's wire costs, so no time is reported there.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["COST_PROPERTY", "Cost", "CostChange", "combine_ranks", "cost_from_json", "cost_regressions",
           "cost_table", "hook_cost", "over_max", "parse_property", "ratio_text"]

#: The JUnit property that carries a case's cost (compact JSON of :func:`combine_ranks`).
COST_PROPERTY = "cost"
#: The figures summed per side and compared as ratios.
_TOTALS = ("collectives", "bytes", "elements")
#: A side's breakdowns, name -> figure; ``rescaled_from`` only on native's side of a reduced-precision claim.
_BREAKDOWNS = ("by_kind", "bytes_by_dtype", "rescaled_from")
#: A hook's ratio may grow this much (relative) against a baseline before it is a regression: the means over ranks
#: are exact counts, so only a change in what the hook sends moves them.
REGRESSION_TOLERANCE = 0.01


def _mean(values: Sequence[float]) -> float:
    m = sum(values) / len(values)
    return int(m) if float(m).is_integer() else round(m, 3)


def _side(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One side's figures, the mean over the ranks (counts by kind and bytes by dtype too)."""
    out: Dict[str, Any] = {name: _mean([float(r.get(name, 0)) for r in per_rank]) for name in _TOTALS}
    for key in _BREAKDOWNS:
        names = sorted({k for r in per_rank for k in (r.get(key) or {})})
        if names or key != "rescaled_from":
            out[key] = {k: _mean([float((r.get(key) or {}).get(k, 0)) for r in per_rank]) for k in names}
    if all("ms" in r for r in per_rank):
        out["ms"] = round(max(float(r["ms"]) for r in per_rank), 4)
    return out


def combine_ranks(costs: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
    """A case's cost from its ranks' (:func:`conformance.ranks.cost.read`): per side the mean per rank of each
    figure, the step measured, and whether it is warm; ``{"not_measured": why}`` where a rank could not measure;
    ``{}`` where no rank measured (a check that trains one model).

    The ranks measure the same step (every rank trains in step), so the mean is each rank's share: on a symmetric
    hook, every rank's own figures."""
    measured = [c for c in costs if c]
    if not measured:
        return {}
    lost = [c["not_measured"] for c in measured if "not_measured" in c]
    if lost:
        return {"not_measured": lost[0]}
    usable = [c for c in measured if "native" in c and "hooked" in c]
    if not usable:
        return {}
    step = min(int(c.get("step", 0)) for c in usable)
    usable = [c for c in usable if int(c.get("step", 0)) == step]
    out = {"step": step, "warm": step > 0, "ranks": len(usable),
           "native": _side([c["native"] for c in usable]), "hooked": _side([c["hooked"] for c in usable])}
    meter = [float(c["meter_ms"]) for c in usable if "meter_ms" in c]
    if meter:  # the slowest rank's: the ranks measure side by side
        out["meter_ms"] = round(max(meter), 3)
    return out


def parse_property(value: object) -> Optional[Dict[str, Any]]:
    """A case's cost from its JUnit property (a JSON string, or the dict itself), ``None`` where unreadable."""
    if isinstance(value, dict):
        return value
    try:
        data = json.loads(str(value))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def ratio_text(r: Optional[float]) -> str:
    """``1.0x``, ``0.50x``, ``12x``, ``0.031x``: a ratio with two significant figures, ``n/a`` for none."""
    if r is None:
        return "n/a"
    if r >= 10:
        return f"{r:.0f}x"
    if r >= 1:
        return f"{r:.1f}x"
    if r >= 0.1:
        return f"{r:.2f}x"
    return f"{r:.2g}x"


def _listed(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else ""


def _ratio(a: float, b: float) -> Optional[float]:
    if b:
        return a / b
    return None if a else 1.0


@dataclasses.dataclass(frozen=True)
class Cost:
    """A hook's cost over its measured cases, against native's over the same cases.

    Attributes:
        cases: cases whose step was measured on both models, passed or failed alike (what a hook sends does not
            depend on whether its values were right); skipped cases are left out (:func:`hook_cost`).
        warm: of those, the cases whose measured step was past step 0 (the others ended at step 0).
        native, hooked: per side, the figures summed over those cases (each a step's mean per rank):
            ``collectives``, ``bytes``, ``elements``, ``by_kind`` (kind -> collectives), ``bytes_by_dtype``.
        ms: ``(native, hooked)`` milliseconds summed over the cases timed with CUDA events, or ``None`` (CPU).
        not_measured: why a case could not be measured, per reason: the number of cases.
    """

    cases: int
    warm: int
    native: Dict[str, Any]
    hooked: Dict[str, Any]
    ms: Optional[Tuple[float, float]] = None
    not_measured: Dict[str, int] = dataclasses.field(default_factory=dict)

    def ratio(self, figure: str) -> Optional[float]:
        """The hooked model's ``figure`` (``collectives``, ``bytes``, ``elements``) over native's; ``None`` where no
        case was measured."""
        if not self.cases:
            return None
        return _ratio(float(self.hooked.get(figure, 0)), float(self.native.get(figure, 0)))

    @property
    def time_ratio(self) -> Optional[float]:
        return None if self.ms is None else _ratio(self.ms[1], self.ms[0])

    def wire_dtypes(self, side: str = "hooked") -> List[str]:
        """The dtypes of a side's bytes, the most bytes first."""
        by_dtype = getattr(self, side).get("bytes_by_dtype") or {}
        return [d for d, _ in sorted(by_dtype.items(), key=lambda kv: (-kv[1], kv[0])) if by_dtype[d]]

    @property
    def text(self) -> str:
        """``cost vs native: 1.0x collectives, 0.50x bytes (float16 on the wire; native float32); 12 cases``."""
        if not self.cases:
            n = sum(self.not_measured.values())
            return f"cost vs native: not measured in any of its {n} case(s) ({next(iter(self.not_measured), '')})"
        parts = [f"{ratio_text(self.ratio('collectives'))} collectives", f"{ratio_text(self.ratio('bytes'))} bytes"]
        hooked, native = self.wire_dtypes("hooked"), self.wire_dtypes("native")
        wire = ""
        if hooked and hooked != native:
            wire = f" ({_listed(hooked)} on the wire; native {_listed(native) or 'nothing'})"
        if self.time_ratio is not None:
            parts.append(f"{ratio_text(self.time_ratio)} time")
        line = f"cost vs native: {', '.join(parts)}{wire}; per step over {self.cases} case(s)"
        if self.warm < self.cases:
            line += f", {self.cases - self.warm} of them at step 0 only"
        if self.not_measured:
            n = sum(self.not_measured.values())
            line += f"; {n} case(s) not measured ({next(iter(self.not_measured))})"
        return line

    def to_json(self) -> Dict[str, Any]:
        return {"cases": self.cases, "warm_cases": self.warm, "native": self.native, "hooked": self.hooked,
                "collectives_ratio": self.ratio("collectives"), "bytes_ratio": self.ratio("bytes"),
                "elements_ratio": self.ratio("elements"), "time_ratio": self.time_ratio,
                "ms": None if self.ms is None else {"native": self.ms[0], "hooked": self.ms[1]},
                "wire_dtypes": self.wire_dtypes("hooked"), "native_wire_dtypes": self.wire_dtypes("native"),
                "not_measured": dict(self.not_measured)}


def cost_from_json(data: Mapping[str, Any]) -> Cost:
    """The :class:`Cost` of a ``hooks[].cost`` object."""
    ms = data.get("ms")
    return Cost(cases=int(data.get("cases", 0)), warm=int(data.get("warm_cases", 0)),
                native=dict(data.get("native") or {}), hooked=dict(data.get("hooked") or {}),
                ms=None if not ms else (float(ms["native"]), float(ms["hooked"])),
                not_measured=dict(data.get("not_measured") or {}))


def _add(total: Dict[str, Any], side: Mapping[str, Any]) -> None:
    for name in _TOTALS:
        total[name] = total.get(name, 0) + side.get(name, 0)
    for key in _BREAKDOWNS:
        if key == "rescaled_from" and not side.get(key):
            continue
        into = total.setdefault(key, {})
        for k, v in (side.get(key) or {}).items():
            into[k] = into.get(k, 0) + v


def hook_cost(records: Iterable[Any], hook: str) -> Optional[Cost]:
    """``hook``'s :class:`Cost` over its cases among ``records`` (:class:`~conformance.reports.results.CaseRecord`)
    whose cost was measured, skipped cases left out, or ``None`` where none was."""
    native: Dict[str, Any] = {}
    hooked: Dict[str, Any] = {}
    cases = warm = 0
    ms = [0.0, 0.0]
    timed = True
    lost: Dict[str, int] = {}
    for r in records:
        # a skipped case's verdict is not the hook's (the API never called it, or the reference cannot run)
        c = getattr(r, "cost", None) if r.hook == hook and r.outcome != "skipped" else None
        if not c:
            continue
        if "not_measured" in c:
            lost[str(c["not_measured"])] = lost.get(str(c["not_measured"]), 0) + 1
            continue
        cases += 1
        warm += bool(c.get("warm"))
        _add(native, c["native"])
        _add(hooked, c["hooked"])
        timed = timed and "ms" in c["native"] and "ms" in c["hooked"]
        if timed:
            ms[0] += float(c["native"]["ms"])
            ms[1] += float(c["hooked"]["ms"])
    if not cases and not lost:
        return None
    for side in (native, hooked):
        for name in _TOTALS:
            side[name] = round(side.get(name, 0), 3)
    return Cost(cases=cases, warm=warm, native=native, hooked=hooked,
                ms=(ms[0], ms[1]) if timed and cases else None, not_measured=lost)


def over_max(cost: Optional[Cost], max_ratio: float) -> List[str]:
    """What of ``cost`` exceeds native's by more than ``max_ratio`` (``--max-cost``): ``"2.0x bytes"``, ..."""
    if cost is None or not cost.cases:
        return []
    out = []
    for figure in ("collectives", "bytes"):
        r = cost.ratio(figure)
        if r is not None and r > max_ratio:
            out.append(f"{ratio_text(r)} {figure}")
    return out


@dataclasses.dataclass(frozen=True)
class CostChange:
    """A hook whose cost against native grew since the baseline: ``figure``'s ratio then and now."""

    hook: str
    figure: str
    before: float
    after: float

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        return f"{self.hook}: {self.figure} {ratio_text(self.before)} -> {ratio_text(self.after)} of native's"


def cost_regressions(baseline: Mapping[str, Any], costs: Mapping[str, Optional[Cost]]) -> List[CostChange]:
    """The hooks whose collectives or bytes against native grew by more than :data:`REGRESSION_TOLERANCE` since the
    ``baseline`` document (its ``hooks[].cost``); a hook either run did not measure has nothing to compare."""
    then = {h.get("name"): h.get("cost") for h in baseline.get("hooks") or () if isinstance(h, Mapping)}
    out: List[CostChange] = []
    for hook, cost in costs.items():
        old = then.get(hook)
        if cost is None or not cost.cases or not old or not old.get("cases"):
            continue
        before = cost_from_json(old)
        for figure in ("collectives", "bytes"):
            a, b = before.ratio(figure), cost.ratio(figure)
            if a is not None and b is not None and b > a * (1 + REGRESSION_TOLERANCE):
                out.append(CostChange(hook, figure, a, b))
    return out


def cost_table(hooks: Sequence[Mapping[str, Any]]) -> List[str]:
    """The Markdown cost table of a results document's hooks (those with a measured ``cost``)."""
    rows = []
    for h in hooks:
        c = h.get("cost")
        if not c or not c.get("cases"):
            continue
        cost = cost_from_json(c)
        per = max(cost.cases, 1)
        rows.append(f"| `{h.get('name')}` | {ratio_text(cost.ratio('collectives'))} | "
                    f"{ratio_text(cost.ratio('bytes'))} | {cost.hooked.get('collectives', 0) / per:.3g} | "
                    f"{cost.native.get('collectives', 0) / per:.3g} | {', '.join(cost.wire_dtypes()) or '-'} | "
                    f"{ratio_text(cost.time_ratio) if cost.time_ratio is not None else '-'} | {cost.cases} |")
    if not rows:
        return []
    return ["| hook | collectives vs native | bytes vs native | collectives a step | native's | on the wire "
            "| time vs native | cases |", "|---|---|---|---|---|---|---|---|", *rows]
