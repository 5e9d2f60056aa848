"""The run's results as one JSON document: the environment, every case, the per-hook verdicts.

The document's schema is ``conformance/reports/results.schema.json`` (JSON Schema
draft 2020-12), its fields are described in ``docs/results.md``, and its
version is :data:`SCHEMA_VERSION`. Start with :class:`CaseRecord` (one case,
built from pytest's ``TestReport`` by :mod:`conformance.reports.results_plugin`) and
:func:`build_document`.

Everything here is plain data and standard library: no torch, no pytest, so
the baseline diff (:mod:`conformance.reports.baseline`), the matrix
(:mod:`conformance.reports.matrix`) and the tests use it without a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from conformance.protocol import Cause
from conformance.shared.files import write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from jsonschema import ValidationError

__all__ = ["CaseRecord", "FAILING", "FIGURE_NAMES", "Figure", "OUTCOMES", "ResultsError", "SCHEMA_FILE",
           "SCHEMA_VERSION", "ShortFigure", "build_document", "cause_fields", "cause_line", "figure_value",
           "hook_causes", "hook_families", "hook_fixes", "load_results", "parse_figure",
           "records_from_json", "schema", "schema_problems", "unwritable_reason", "write_json"]

#: ``MAJOR.MINOR``. A minor bump only adds optional fields; a major bump renames, removes or
#: changes the meaning of a field, and a baseline of another major version is refused.
SCHEMA_VERSION = "1.13"
#: The JSON Schema of the document (draft 2020-12).
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.schema.json")

#: Every case outcome, as the JSON ``outcome`` field spells it. ``error`` is a failure outside
#: the test body (setup or teardown); ``xfailed`` a known failure; ``xpassed`` a known failure
#: that passed.
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
#: The outcomes that fail a run.
FAILING = frozenset({"failed", "error"})

#: The figures a case may carry, by JUnit property name: the largest ULP and absolute
#: differences over a failure's findings, and a lossy hook's observed figures.
FIGURE_NAMES = ("max_ulp_diff", "max_abs_diff", "observed_rel_error", "observed_loss_rel_diff")


class ResultsError(ValueError):
    """A results file cannot be read or is not a results document; the message names the file."""


@dataclasses.dataclass
class CaseRecord:
    """One case of the run, as the JSON ``cases`` array holds it.

    Attributes:
        id: the pytest node id (``test_ddp.py::test_ddp_parity[my_hook-default-net-ws2]``),
            the key a baseline diff matches cases by.
        name: the test name (``test_ddp_parity[my_hook-default-net-ws2]``), what ``-k`` selects.
        outcome: one of :data:`OUTCOMES`.
        duration_s: seconds, setup, call and teardown together (pytest's ``TestReport.duration``).
        hook, api, check, variant, variant_field, model, rule, world_size: the case's
            JUnit properties (:meth:`conformance.cases.CaseParams.junit_properties`);
            ``variant_field`` is ``"strategy"`` (fsdp) or ``"config"`` (ddp, fsdp2).
        known_failure_reason: the known-failures entry's reason of an ``xfailed`` or
            ``xpassed`` case.
        skip_reason: why a ``skipped`` case did not run.
        figures: by name (:data:`FIGURE_NAMES`), a float (``inf`` and ``nan`` too), as measured; JSON
            writes it with :func:`figure_value`.
        nodes: the node layout the case ran under (1, or the nodes it simulated with torchrun's variables).
        reach: what its ranks measured (:mod:`conformance.ranks.reach`): ``steps`` (training steps of the hooked
            model) and ``buffer_bytes`` (the largest buffer the hook was handed); ``None`` where the hook was
            never called (a skip, a registration rule).
        cost: what one training step of the hooked model and of native cost, the mean per rank
            (:func:`conformance.reports.cost.combine_ranks`: collectives by kind, bytes by dtype), or
            ``{"not_measured": why}``; ``None`` where no step of both models was measured.
        failure: of a failed case: ``header`` (the failure's first line), ``findings``
            (the first findings, one line each), ``message`` (the failure text, cut at
            :data:`MAX_MESSAGE_CHARS`), ``rerun`` (the command that re-runs it), ``causes`` (the
            causes the diagnosis named, by their words), ``families`` (cause -> its family, what makes two
            causes the same whatever their numbers: :attr:`conformance.protocol.Cause.family`) and, where some
            cause implies one, ``fixes`` (cause -> its fix): :func:`cause_fields`.
    """

    id: str
    name: str
    outcome: str = "passed"
    duration_s: float = 0.0
    hook: Optional[str] = None
    api: Optional[str] = None
    check: Optional[str] = None
    variant: Optional[str] = None
    variant_field: Optional[str] = None
    model: Optional[str] = None
    rule: Optional[str] = None
    world_size: Optional[int] = None
    known_failure_reason: Optional[str] = None
    skip_reason: Optional[str] = None
    figures: Dict[str, float] = dataclasses.field(default_factory=dict)
    failure: Optional[Dict[str, Any]] = None
    nodes: Optional[int] = None
    reach: Optional[Dict[str, int]] = None
    cost: Optional[Dict[str, Any]] = None

    @property
    def failing(self) -> bool:
        return self.outcome in FAILING

    def to_json(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["duration_s"] = round(self.duration_s, 6)
        out["figures"] = {k: figure_value(v) for k, v in self.figures.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CaseRecord":
        fields = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in fields})
        record.figures = {k: parse_figure(v) for k, v in (data.get("figures") or {}).items()}
        return record


#: A failure's text kept in the JSON, in characters (the JUnit XML has it whole).
MAX_MESSAGE_CHARS = 4000


def figure_value(x: float) -> Any:
    """A figure as JSON can hold it: the number itself, or ``"inf"``, ``"-inf"``, ``"nan"``.

    JSON has no infinity, and an infinite ULP difference (NaN against a number) is a real
    figure, so non-finite values travel as these three strings.
    """
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return int(x) if x.is_integer() and abs(x) < 2**53 else x


def parse_figure(value: Union[float, str]) -> float:
    """The inverse of :func:`figure_value`: a figure of a results file (a number, ``"inf"``, ``"-inf"``,
    ``"nan"``) as a float.

    Raises:
        ValueError: not a number nor one of ``inf``, ``-inf``, ``nan``.
    """
    return float(value)


class Figure(float):
    """A figure of a case (ULPs, an absolute or relative error) as the float it is, carried in the case's
    ``user_properties`` to its :class:`CaseRecord`; only its ``str``, which pytest's JUnit writer calls,
    is text: exact, as JSON has it (``2``, ``2.384185791015625e-07``, ``inf``)."""

    def __str__(self) -> str:
        return str(figure_value(self))


class ShortFigure(Figure):
    """A lossy contract's figure: a float whose JUnit property text has four significant digits
    (``1.234e-03``), or ``inf``."""

    def __str__(self) -> str:
        return "inf" if math.isinf(self) else f"{float(self):.3e}"


def build_document(*, suite_version: str, run: Mapping[str, Any], environment: Mapping[str, Any],
                   hooks: Sequence[Mapping[str, Any]], cases: Sequence[CaseRecord],
                   baseline: Optional[Mapping[str, Any]] = None, source_digest: Optional[str] = None) -> Dict[str, Any]:
    """The results document (see ``docs/results.md`` for every field).

    Args:
        suite_version: ``conformance.__version__``.
        run: ``started_at``, ``finished_at`` (ISO 8601, UTC), ``duration_s``, ``exit_status``
            (the run's exit code), ``interrupted``, ``args`` (the command line).
        environment: torch version and build, backend, device, world sizes, ...
        hooks: per hook: its claims, source, verdict, outcome counts and matrix.
        cases: every case, in the order they ran.
        baseline: the baseline diff (:meth:`conformance.reports.baseline.BaselineDiff.to_json`), or ``None``.
        source_digest: :func:`conformance.reports.source_digest.source_digest` of the suite that ran, or ``None``
            (left out).
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "suite": {"name": "commhook-conformance", "version": suite_version,
                  **({} if source_digest is None else {"source_digest": source_digest})},
        "run": dict(run),
        "environment": dict(environment),
        "hooks": [dict(h) for h in hooks],
        "cases": [c.to_json() for c in cases],
        "baseline": None if baseline is None else dict(baseline),
    }


def schema() -> Dict[str, Any]:
    """The JSON Schema of the results document, from :data:`SCHEMA_FILE`."""
    with open(SCHEMA_FILE, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, document: Mapping[str, Any]) -> None:
    """Write the results document to ``path`` atomically (:func:`conformance.shared.files.write_atomic`), as strict
    JSON.

    Raises:
        ValueError: a value JSON cannot hold (NaN or infinity outside :func:`figure_value`).
        OSError: as :func:`conformance.shared.files.write_atomic`.
    """
    write_atomic(path, json.dumps(document, indent=1, allow_nan=False) + "\n")


def load_results(path: str) -> Dict[str, Any]:
    """Read a results document written by this suite, of this major schema version, valid against :func:`schema`.

    Raises:
        ResultsError: the file cannot be read, is not JSON, is not a results document, has
            another major ``schema_version``, or does not match the schema (the message names the
            first bad entry and field: :func:`schema_problems`); the message names the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ResultsError(f"cannot read results file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ResultsError(f"results file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "schema_version" not in data or not isinstance(data.get("cases"), list):
        raise ResultsError(f"{path} is not a conformance results file (no schema_version or cases): "
                           "give a file written by --json")
    version = str(data["schema_version"])
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ResultsError(f"results file {path} has schema_version {version}, but this suite reads "
                           f"{SCHEMA_VERSION.split('.')[0]}.x: rerun the baseline with this suite's version")
    problems = schema_problems(data)
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise ResultsError(f"results file {path} does not match the results schema ({os.path.basename(SCHEMA_FILE)}): "
                           f"{problems[0]}{more}. Give a file written by --json, unedited, or run once without "
                           "--baseline to write a new one")
    return data


def schema_problems(data: object) -> List[str]:
    """What makes ``data`` not a results document of :func:`schema`, first in document order, one line each.

    Each line names the entry (``cases[3] (id 'test_ddp.py::...')``, ``hooks[0] (name 'my_hook')``,
    ``run``) and the field: ``cases[3] (id '...') lacks the field 'outcome'``. Empty when ``data`` is valid.
    """
    import jsonschema  # heavy (about 0.2 s), and only a --baseline or a test validates a document

    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(data),
                    key=lambda e: tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in e.absolute_path))
    # ``required`` reports each missing field of an entry on its own; one line per entry says them all.
    return list(dict.fromkeys(_problem(error, data) for error in errors))


def _problem(error: ValidationError, data: Any) -> str:  # Any: the JSON document, read along the error's path
    parts = list(error.absolute_path)
    # The entry: a top-level field, or one element of an array (named by its id or name, which a reader can find).
    depth = 2 if len(parts) >= 2 and isinstance(parts[1], int) else min(len(parts), 1)
    where = "the document" if not depth else (f"{parts[0]}[{parts[1]}]" if depth == 2 else str(parts[0]))
    if depth == 2:
        entry = data[parts[0]][parts[1]]
        key = next((k for k in ("id", "name") if isinstance(entry, dict) and k in entry), None)
        if key is not None:
            where += f" ({key} {entry[key]!r})"
    field = ".".join(str(p) for p in parts[depth:])
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [f for f in error.validator_value if f not in error.instance]
        names = ", ".join(repr(f"{field}.{m}" if field else m) for m in missing)
        return f"{where} lacks the field{'s' if len(missing) > 1 else ''} {names}"
    return f"{where}, field {field!r}: {error.message}" if field else f"{where}: {error.message}"


def unwritable_reason(path: str) -> Optional[str]:
    """Why a report cannot be written at ``path``, or ``None`` if it can.

    Creates the parent directories, as pytest does for ``--junitxml``, then
    creates and removes a probe file there (``os.access`` says yes to root on a
    read-only directory). Nothing is written at ``path`` itself.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return f"{path} is a directory"
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".conform-probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {directory}: {exc.strerror or exc}"
    return None


def records_from_json(data: Mapping[str, Any]) -> List[CaseRecord]:
    """The case records of a loaded results document."""
    return [CaseRecord.from_json(c) for c in data.get("cases", [])]


def cause_fields(causes: Iterable[Cause]) -> Dict[str, Any]:
    """A failure record's ``causes`` (each cause's words, once), ``families`` (words -> the cause's
    :attr:`~conformance.protocol.Cause.family`) and ``fixes`` (words -> the fix, where one follows), from the
    causes its findings carry (:attr:`conformance.protocol.Finding.causes`, every finding's in turn).

    The causes go in the order of how many findings name their family, most first, then in the order named: a
    cause that explains every diagnosed call of the case comes before one that a small call, where several
    causes give the same bits, names beside it (:func:`hook_causes` then tells the case's story by it)."""
    given = list(causes)
    per_family: Dict[str, int] = {}
    for c in given:
        per_family[c.family] = per_family.get(c.family, 0) + 1
    named = sorted(dict.fromkeys(given), key=lambda c: -per_family[c.family])
    return {"causes": list(dict.fromkeys(c.words for c in named)),
            "fixes": {c.words: c.fix for c in named if c.fix},
            "families": {c.words: c.family for c in named}}


def hook_families(records: Iterable[CaseRecord], hook: str) -> Dict[str, str]:
    """The family of each cause ``hook``'s failed cases named, by its words (``failure.families``): a cause of a
    file from before causes had families (1.13) is its own."""
    out: Dict[str, str] = {}
    for rec in records:
        if rec.hook == hook and rec.failing and rec.failure:
            for cause, family in (rec.failure.get("families") or {}).items():
                out.setdefault(cause, family)
    return out


def hook_causes(records: Iterable[CaseRecord], hook: str) -> List[Tuple[str, int]]:
    """The causes the diagnosis named across ``hook``'s failed cases, ``(cause, failed cases naming it)``, each
    counted once per case, by its own words: ``divided by 3`` at 3 ranks and ``divided by 2`` at 2 are two
    entries, each with the cases it explains. Ordered by family (causes that differ only in their numbers, the
    world size, a rank, an index range: :func:`hook_families`), the family of most cases first, then most cases
    first within it (ties in the order the cases ran): :func:`cause_line` tells the first family as one story."""
    records = list(records)
    counts: Dict[str, int] = {}
    for rec in records:
        if rec.hook == hook and rec.failing and rec.failure:
            for cause in dict.fromkeys(rec.failure.get("causes") or ()):
                counts[cause] = counts.get(cause, 0) + 1
    families = hook_families(records, hook)
    key = {cause: families.get(cause, cause) for cause in counts}
    order = {cause: i for i, cause in enumerate(counts)}
    family: Dict[str, int] = {}
    first: Dict[str, int] = {}
    for cause, n in counts.items():
        family[key[cause]] = family.get(key[cause], 0) + n
        first.setdefault(key[cause], order[cause])
    return sorted(counts.items(), key=lambda kv: (-family[key[kv[0]]], first[key[kv[0]]], -kv[1], order[kv[0]]))


def hook_fixes(records: Iterable[CaseRecord], hook: str) -> Dict[str, str]:
    """The fix each cause of :func:`hook_causes` implies, by the cause (causes with no fix left out): the fix the
    first failed case naming it recorded (``failure.fixes``)."""
    fixes: Dict[str, str] = {}
    for rec in records:
        if rec.hook == hook and rec.failing and rec.failure:
            for cause, fix in (rec.failure.get("fixes") or {}).items():
                fixes.setdefault(cause, fix)
    return {cause: fixes[cause] for cause, _ in hook_causes(records, hook) if cause in fixes}


def cause_line(causes: Sequence[Tuple[str, int]], failed: int,
               families: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A hook's most common named cause in one line, for the terminal and the Markdown, or ``None``: the first
    family of :func:`hook_causes` (causes that differ only in their numbers), each of its causes with the cases it
    explains (``SUM, then divided by 2: 5 cases; SUM, then divided by 3: 3 cases (8 of 8 failed cases)``).

    Args:
        causes: :func:`hook_causes` of the hook (from the case records, or the JSON's ``hooks[].causes``).
        failed: the hook's failed cases.
        families: each cause's family, by its words (:func:`hook_families`, or the JSON's
            ``hooks[].causes[].family``); a cause without one is its own.
    """
    if not causes:
        return None
    family = dict(families or {})
    key = family.get(causes[0][0], causes[0][0])
    story = [(cause, n) for cause, n in causes if family.get(cause, cause) == key]
    others = len({family.get(cause, cause) for cause, _ in causes} - {key})
    rest = f"; {others} other cause(s) named" if others else ""
    if len(story) == 1:
        return f"most failures explained by: {story[0][0]} ({story[0][1]} of {failed} failed cases{rest})"
    each = "; ".join(f"{cause}: {n} case{'s' if n != 1 else ''}" for cause, n in story)
    return f"most failures explained by: {each} ({sum(n for _, n in story)} of {failed} failed cases{rest})"

