"""This run against an earlier one: new failures, fixed cases, cases that came and went, figures that moved.

``--baseline PREVIOUS.json`` loads a results file of an earlier run
(:func:`conformance.reports.results.load_results`); :func:`diff_runs` compares its
cases with this run's, matched by case id (the pytest node id), and
:func:`options_changed` says where the two runs were asked for different cases (a
``--depth nightly`` baseline against a default run: cases disappear that no hook
lost). With ``--fail-on regressions`` the exit code depends only on
:attr:`BaselineDiff.regressions`: the new failures, the branches of a hook's own code that no case took
this time where the baseline's cases took them (the baseline remembers each hook's never-taken branches in its
``hooks[].hook_code``), and a hook whose cost against native grew (its ``hooks[].cost``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

from conformance.reports.cost import CostChange
from conformance.reports.results import CaseRecord, figure_value, records_from_json

__all__ = ["BaselineDiff", "BranchChange", "Change", "FigureChange", "diff_markdown", "diff_runs", "diff_text",
           "new_never_taken", "options_changed"]

#: Cases listed per category in the terminal and the Markdown; the JSON lists them all.
MAX_LISTED = 20
#: The results' ``environment`` fields that decide which cases a run plans and how it runs them
#: (``docs/results.md``); a field a results file lacks (an older schema) is not compared.
OPTION_FIELDS = ("depth", "with_compiled_ddp", "world_sizes", "hypothesis_examples", "backend", "device",
                 "torch_version")
#: The pytest options that select cases, read from the results' ``run.args``.
_SELECTION = {"-k": "-k", "--keyword": "-k", "-m": "-m"}


@dataclasses.dataclass(frozen=True)
class Change:
    """A case's outcome then and now; ``before`` (or ``after``) is ``None`` where the case did not exist."""

    id: str
    before: Optional[str]
    after: Optional[str]
    hook: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        return f"{self.id}: {self.before or 'absent'} -> {self.after or 'absent'}"


@dataclasses.dataclass(frozen=True)
class FigureChange:
    """A figure of a case that both runs have, with two different values (``None``: not measured then)."""

    id: str
    figure: str
    before: Optional[float]
    after: Optional[float]

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "figure": self.figure,
                "before": None if self.before is None else figure_value(self.before),
                "after": None if self.after is None else figure_value(self.after)}

    def text(self) -> str:
        def show(x: Optional[float]) -> str:
            return "none" if x is None else repr(figure_value(x)).strip("'")
        return f"{self.id}: {self.figure} {show(self.before)} -> {show(self.after)}"


@dataclasses.dataclass(frozen=True)
class BranchChange:
    """A branch of a hook's own code that no case of this run took, where the baseline run took it (or the
    branch is new): ``where`` (``file:line``), its ``source`` line and ``how`` it was not taken."""

    hook: str
    where: str
    source: str
    how: str

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        return f"{self.hook}: {self.where} {self.source} ({self.how})"


def _branch_keys(branches: Sequence[Mapping[str, Any]]) -> Dict[tuple, Mapping[str, Any]]:
    """Never-taken branches by what survives an edit elsewhere in the file: file, source text, how, and the
    how-many-th such (lines move when code above them changes)."""
    out: Dict[tuple, Mapping[str, Any]] = {}
    seen: Dict[tuple, int] = {}
    for b in branches:
        key = (b.get("file"), " ".join(str(b.get("source", "")).split()), b.get("how"))
        seen[key] = seen.get(key, 0) + 1
        out[key + (seen[key],)] = b
    return out


def new_never_taken(baseline: Mapping[str, Any], hook_code: Mapping[str, Mapping[str, Any]]) -> List[BranchChange]:
    """The branches never taken now (``hook_code``: hook -> its ``hooks[].hook_code``) that the baseline run took,
    per hook whose code both runs measured (a hook the baseline did not measure has nothing to regress from)."""
    then = {h.get("name"): h.get("hook_code") for h in baseline.get("hooks") or () if isinstance(h, Mapping)}
    out: List[BranchChange] = []
    for hook, code in hook_code.items():
        old = then.get(hook)
        if not (code and code.get("measured") and old and old.get("measured")):
            continue
        before = _branch_keys(old.get("never_taken") or ())
        for key, b in _branch_keys(code.get("never_taken") or ()).items():
            if key not in before:
                out.append(BranchChange(hook, f"{b['file']}:{b['line']}", str(b.get("source", "")), str(b.get("how"))))
    return out


@dataclasses.dataclass
class BaselineDiff:
    """How this run differs from the baseline.

    Attributes:
        baseline: the baseline file's path.
        baseline_started_at: when the baseline run started (its ``run.started_at``), or ``None``.
        new_failures: cases that fail now (``failed`` or ``error``) and did not fail in the
            baseline, new cases included: the regressions.
        fixed: cases that failed in the baseline and pass now (``passed`` or ``xpassed``).
        appeared: cases of this run that the baseline does not have (``before`` is ``None``).
        disappeared: cases of the baseline that this run does not have (``after`` is ``None``).
        changed_outcomes: every other case whose outcome changed (``passed`` -> ``skipped``,
            ``failed`` -> ``xfailed``, ...).
        changed_figures: figures (max ULP and absolute differences, lossy errors) of cases in
            both runs whose values differ; none of a new failure, whose figures are its own
            (in its case record), not a change to list twice.
        options_changed: where the two runs were asked for different cases or settings
            (:func:`options_changed`), one ``"what before -> now"`` each: cases that appeared or
            disappeared there may be the options', not the hooks'.
        new_never_taken: branches of a hook's own code that no case took this time, where the baseline's cases
            took them (:func:`new_never_taken`): regressions too.
        cost_regressions: hooks whose collectives or bytes per step against native grew since the baseline
            (:func:`conformance.reports.cost.cost_regressions`): regressions too.
    """

    baseline: str
    baseline_started_at: Optional[str] = None
    new_failures: List[Change] = dataclasses.field(default_factory=list)
    fixed: List[Change] = dataclasses.field(default_factory=list)
    appeared: List[Change] = dataclasses.field(default_factory=list)
    disappeared: List[Change] = dataclasses.field(default_factory=list)
    changed_outcomes: List[Change] = dataclasses.field(default_factory=list)
    changed_figures: List[FigureChange] = dataclasses.field(default_factory=list)
    options_changed: List[str] = dataclasses.field(default_factory=list)
    new_never_taken: List[BranchChange] = dataclasses.field(default_factory=list)
    cost_regressions: List[CostChange] = dataclasses.field(default_factory=list)

    @property
    def regressions(self) -> List[Any]:
        """What ``--fail-on regressions`` fails the run for: :attr:`new_failures`, :attr:`new_never_taken` and
        :attr:`cost_regressions`."""
        return [*self.new_failures, *self.new_never_taken, *self.cost_regressions]

    def empty(self) -> bool:
        return not (self.new_failures or self.fixed or self.appeared or self.disappeared or self.changed_outcomes
                    or self.changed_figures or self.new_never_taken or self.cost_regressions)

    def counts(self) -> Dict[str, int]:
        return {name: len(getattr(self, name)) for name in _CATEGORIES}

    def to_json(self) -> Dict[str, Any]:
        """The JSON ``baseline`` object: the file, counts, and every change of every category."""
        out: Dict[str, Any] = {"path": self.baseline, "started_at": self.baseline_started_at,
                               "counts": self.counts()}
        for name in _CATEGORIES:
            out[name] = [c.to_json() for c in getattr(self, name)]
        out["options_changed"] = list(self.options_changed)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "BaselineDiff":
        """The inverse of :meth:`to_json` (for rendering a results document)."""
        def changes(name: str) -> List[Any]:
            if name == "changed_figures":
                return [FigureChange(c["id"], c["figure"], *(None if c[k] is None else float(c[k])
                                                              for k in ("before", "after")))
                        for c in data.get(name, [])]
            if name == "new_never_taken":
                return [BranchChange(c["hook"], c["where"], c["source"], c["how"]) for c in data.get(name, [])]
            if name == "cost_regressions":
                return [CostChange(c["hook"], c["figure"], float(c["before"]), float(c["after"]))
                        for c in data.get(name, [])]
            return [Change(c["id"], c.get("before"), c.get("after"), c.get("hook")) for c in data.get(name, [])]

        return cls(baseline=data.get("path", ""), baseline_started_at=data.get("started_at"),
                   options_changed=list(data.get("options_changed", [])),
                   **{name: changes(name) for name in _CATEGORIES})


_CATEGORIES = ("new_failures", "fixed", "appeared", "disappeared", "changed_outcomes", "changed_figures",
               "new_never_taken", "cost_regressions")
_TITLES = {"new_failures": "new failures", "fixed": "fixed", "appeared": "appeared",
           "disappeared": "disappeared", "changed_outcomes": "other outcome changes",
           "changed_figures": "changed figures", "new_never_taken": "newly never-taken branches",
           "cost_regressions": "cost regressions"}


def _same(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def diff_runs(baseline: Mapping[str, Any], current: Sequence[CaseRecord], baseline_path: str = "") -> BaselineDiff:
    """Compare this run's case records with a loaded baseline document, case by case (by ``id``)."""
    before = {r.id: r for r in records_from_json(baseline)}
    now = {r.id: r for r in current}
    diff = BaselineDiff(baseline=baseline_path, baseline_started_at=(baseline.get("run") or {}).get("started_at"))
    for case_id, rec in now.items():
        old = before.get(case_id)
        if old is None:
            change = Change(case_id, None, rec.outcome, rec.hook)
            diff.appeared.append(change)
            if rec.failing:
                diff.new_failures.append(change)
            continue
        change = Change(case_id, old.outcome, rec.outcome, rec.hook)
        if rec.failing and not old.failing:
            diff.new_failures.append(change)
            continue  # its figures would repeat it as "none -> X"; they are in its case record
        if old.failing and rec.outcome in ("passed", "xpassed"):
            diff.fixed.append(change)
        elif old.outcome != rec.outcome:
            diff.changed_outcomes.append(change)
        for name in sorted(set(old.figures) | set(rec.figures)):
            a, b = old.figures.get(name), rec.figures.get(name)
            if not _same(a, b):
                diff.changed_figures.append(FigureChange(case_id, name, a, b))
    for case_id, old in before.items():
        if case_id not in now:
            diff.disappeared.append(Change(case_id, old.outcome, None, old.hook))
    return diff


def _selection(args: Sequence[str]) -> Dict[str, str]:
    """``{"-k": expression, "-m": expression}`` of a pytest command line (``-k EXPR``, ``-kEXPR``, ``--keyword=EXPR``),
    each as given last."""
    out: Dict[str, str] = {}
    args = list(args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _SELECTION and eq:
            out[_SELECTION[flag]] = value
        elif arg in _SELECTION and i + 1 < len(args):
            out[_SELECTION[arg]] = args[i + 1]
        elif arg[:2] in ("-k", "-m") and len(arg) > 2 and not arg.startswith("--"):
            out[arg[:2]] = arg[2:]
    return out


def _shown(value: object) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def options_changed(baseline: Mapping[str, Any], environment: Mapping[str, Any], hooks: Sequence[str],
                    args: Sequence[str]) -> List[str]:
    """Where this run and the ``baseline`` document were asked for different cases or settings, one
    ``"what before -> now"`` each: the :data:`OPTION_FIELDS` of their ``environment`` (``depth nightly -> default``),
    the hooks under test (``hooks: +new, -gone``) and a ``-k`` or ``-m`` selection (from the ``run.args`` of each).

    Args:
        baseline: the loaded ``--baseline`` results document.
        environment: this run's ``environment`` object; ``hooks``: the names of its hooks under test;
            ``args``: its pytest command line.
    """
    before = baseline.get("environment") or {}
    out = [f"{name} {_shown(before[name])} -> {_shown(environment[name])}" for name in OPTION_FIELDS
           if name in before and name in environment and before[name] != environment[name]]
    then = {h.get("name") for h in baseline.get("hooks") or () if isinstance(h, Mapping)}
    added, gone = sorted(set(hooks) - then), sorted(then - set(hooks))
    if added or gone:
        out.append("hooks: " + ", ".join([f"+{h}" for h in added] + [f"-{h}" for h in gone]))
    picked_then, picked_now = _selection((baseline.get("run") or {}).get("args") or ()), _selection(args)
    for flag in ("-k", "-m"):
        if picked_then.get(flag) != picked_now.get(flag):
            then_expr, now_expr = (repr(e) if e else "none" for e in (picked_then.get(flag), picked_now.get(flag)))
            out.append(f"{flag} {then_expr} -> {now_expr}")
    return out


def _options_line(diff: BaselineDiff) -> str:
    return ("the two runs' options differ, so cases may have appeared or disappeared for that, not for a hook: "
            + "; ".join(diff.options_changed))


def _listed(items: Sequence[Any], code: bool = False) -> List[str]:
    lines = [f"`{item.text()}`" if code else item.text() for item in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(f"... and {len(items) - MAX_LISTED} more (all of them are in the JSON results)")
    return lines


def diff_text(diff: BaselineDiff) -> List[str]:
    """The diff for the terminal: one count line, then each non-empty category with its cases."""
    counts = diff.counts()
    lines = [f"against {diff.baseline}" + (f" (run started {diff.baseline_started_at})"
                                           if diff.baseline_started_at else "") + ": "
             + ", ".join(f"{counts[name]} {_TITLES[name]}" for name in _CATEGORIES)]
    if diff.options_changed:
        lines.append(_options_line(diff))
    for name in _CATEGORIES:
        items = getattr(diff, name)
        if items:
            lines.append(f"{_TITLES[name]}:")
            lines += [f"  {line}" for line in _listed(items)]
    return lines


def diff_markdown(diff: BaselineDiff) -> str:
    """The diff as Markdown: the counts, then each non-empty category as a list."""
    counts = diff.counts()
    out = [f"Against `{diff.baseline}`: " + ", ".join(f"{counts[name]} {_TITLES[name]}" for name in _CATEGORIES)
           + "."]
    if diff.options_changed:
        line = _options_line(diff)
        out += ["", line[0].upper() + line[1:] + "."]
    for name in _CATEGORIES:
        items = getattr(diff, name)
        if items:
            out += ["", f"**{_TITLES[name].capitalize()}**", ""]
            out += [f"- {line}" for line in _listed(items, code=True)]
    return "\n".join(out)
