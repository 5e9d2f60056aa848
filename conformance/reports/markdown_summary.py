"""The results document as Markdown, for people: ``--markdown PATH`` and ``$GITHUB_STEP_SUMMARY``.

:func:`markdown_summary` renders a results document
(:func:`conformance.reports.results.build_document`) alone, so a results file from any
run can be rendered again: the per-hook verdict table, the reasons of the known
failures and skips, the baseline diff, and for each failing hook its grid
(:mod:`conformance.reports.matrix`), its first findings and the command that re-runs
each of those cases.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from conformance.reports.baseline import BaselineDiff, diff_markdown
from conformance.reports.hook_code import hook_code_from_json
from conformance.reports.matrix import HookMatrix, hook_matrix, matrix_markdown
from conformance.reports.cost import cost_table
from conformance.reports.reach import reach_from_json, short_reason
from conformance.reports.results import cause_line, records_from_json

__all__ = ["markdown_summary", "MAX_FAILURES_SHOWN", "MAX_FINDINGS_SHOWN"]

#: Hook statuses shown in bold: the ones a reader must act on.
_ALARMING = ("does_not_conform", "not_checked_across_ranks", "interrupted", "other")
#: Failed cases shown per failing hook, each with its findings and re-run command.
MAX_FAILURES_SHOWN = 3
#: Findings shown per failed case.
MAX_FINDINGS_SHOWN = 3


def _counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if n) or "no cases"


def _environment_line(doc: Mapping[str, Any]) -> str:
    env = doc.get("environment", {})
    run = doc.get("run", {})
    listed = [str(w) for w in env.get("world_sizes", [])]
    sizes = " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 2 else listed)
    build = {"cuda": "CUDA build", "rocm": "ROCm build", "cpu": "CPU build"}.get(env.get("torch_build"), "")
    parts = [f"torch {env.get('torch_version', '?')}" + (f" ({build})" if build else ""),
             f"backend {env.get('backend', '?')}", f"device {env.get('device', '?')}", f"world sizes {sizes}",
             f"{doc.get('suite', {}).get('name', 'commhook-conformance')} {doc.get('suite', {}).get('version', '')}"
             .strip(), f"exit status {run.get('exit_status', '?')}"]
    nccl = env.get("nccl")
    if nccl:  # every NCCL_* variable in force: the bits of a reduction depend on them
        pinned = set(nccl.get("pinned_by_suite", ()))
        variables = ", ".join(f"{k}={v}" + (" (suite)" if k in pinned else "")
                              for k, v in nccl.get("variables", {}).items())
        parts.insert(2, f"NCCL {nccl.get('version') or '?'}" + (f" ({variables})" if variables else ""))
    return " · ".join(parts)


def _failure_block(case: Mapping[str, Any]) -> List[str]:
    failure = case.get("failure") or {}
    lines = [failure.get("header") or case["name"]]
    findings = failure.get("findings") or []
    if findings:
        lines += [f"  {f}" for f in findings[:MAX_FINDINGS_SHOWN]]
        if len(findings) > MAX_FINDINGS_SHOWN:
            lines.append(f"  ... and {len(findings) - MAX_FINDINGS_SHOWN} more findings")
    else:  # a rank raised, hung or died: the first lines of what the failure says
        body = (failure.get("message") or "").splitlines()[1:1 + MAX_FINDINGS_SHOWN + 2]
        lines += [line for line in body if not line.startswith("Re-run just this case")]
    out = [f"`{case['name']}`", "", "```text", *lines, "```"]
    if failure.get("rerun"):
        out += ["Re-run just this case:", "", "```sh", failure["rerun"], "```"]
    return out + [""]


def markdown_summary(doc: Mapping[str, Any]) -> str:
    """The Markdown summary of a results document.

    Sections: a heading with the environment; one table row per hook that had
    cases (api, claim, verdict, outcome counts); the known failures' and skips' reasons, one row per
    hook and reason with its count of cases; the baseline diff, where the document has one; then
    for each hook with a failed case, its grid and its first
    :data:`MAX_FAILURES_SHOWN` failed cases with findings and re-run commands.
    """
    run = doc.get("run", {})
    out = ["## Hook conformance", "", _environment_line(doc), ""]
    if run.get("interrupted"):
        out += [f"**INTERRUPTED** after {len(doc.get('cases', []))} cases: the verdicts below cover only the "
                "cases that ran.", ""]
    out += ["| hook | api | claim | verdict | cases |", "| --- | --- | --- | --- | --- |"]
    unselected, unreached = [], []
    for hook in doc.get("hooks", []):
        if not hook.get("counts"):  # no case of it ran: none selected (-k, ...), or the run stopped before them
            (unreached if hook.get("status") == "interrupted" else unselected).append(hook["name"])
            continue
        verdict = hook.get("verdict", "")
        shown = f"**{verdict}**" if hook.get("status") in _ALARMING else verdict
        out.append(f"| `{hook['name']}` | {hook.get('api', '')} | {_claim(hook)} | {shown} | "
                   f"{_counts_text(hook.get('counts', {}))} |")
    out.append("")
    if unreached:
        out += [f"Not run (interrupted): {', '.join(f'`{n}`' for n in unreached)}: the run stopped before their "
                "cases.", ""]
    if unselected:
        out += [f"No case selected for: {', '.join(f'`{n}`' for n in unselected)}.", ""]
    out += _reach_and_code(doc)
    out += _cost(doc)
    out += _reasons(doc)
    if doc.get("baseline"):
        out += ["### Against the baseline", "", diff_markdown(BaselineDiff.from_json(doc["baseline"])), ""]
    records = records_from_json(doc)
    by_hook: Dict[str, List[Mapping[str, Any]]] = {}
    for case in doc.get("cases", []):
        if case.get("outcome") in ("failed", "error"):
            by_hook.setdefault(case.get("hook") or "", []).append(case)
    for hook in doc.get("hooks", []):
        failed = by_hook.get(hook["name"])
        if not failed:
            continue
        out += [f"### `{hook['name']}`: {hook.get('verdict', '')}", ""]
        named = hook.get("causes") or ()
        line = cause_line([(c["cause"], c["cases"]) for c in named], len(failed),
                          {c["cause"]: c["family"] for c in named if c.get("family")})
        if line:
            out += [f"{line[0].upper()}{line[1:]}.", ""]
            fix = (hook.get("causes") or [{}])[0].get("fix")
            if fix:
                out += [f"Fix: {fix}.", ""]
        # The document's own grid: it holds the cells of cases a stopped run never reached, which no case record does.
        matrix = HookMatrix.from_json(hook["name"], hook["matrix"]) if hook.get("matrix") else \
            hook_matrix(records, hook["name"])
        grid = matrix_markdown(matrix)
        if grid:
            out += [grid, ""]
        out += [f"First findings ({min(len(failed), MAX_FAILURES_SHOWN)} of {len(failed)} failed cases):", ""]
        for case in failed[:MAX_FAILURES_SHOWN]:
            out += _failure_block(case)
    return "\n".join(out).rstrip() + "\n"


def _reach_and_code(doc: Mapping[str, Any]) -> List[str]:
    """Per hook that ran: how far its verdict reaches (what ran together), what of its plan was not checked here
    and why, and which of its own code ran, each never-taken branch with its source line."""
    out: List[str] = []
    for hook in doc.get("hooks", []):
        if not hook.get("counts"):
            continue
        lines = []
        if hook.get("reach"):
            lines.append(f"- reach: {reach_from_json(hook['reach']).text}")
        for item in hook.get("not_checked") or ():
            cases = ", ".join(f"`{c}`" for c in item.get("cases", ()))
            lines.append(f"- not checked here: {cases} ({short_reason(item.get('reason', ''))})")
        if hook.get("hook_code"):
            code = hook_code_from_json(hook["hook_code"])
            lines.append(f"- {code.text}")
            lines += [f"  - `{line}`" for line in code.detail_lines()]
        if lines:
            out += [f"`{hook['name']}`:", "", *lines, ""]
    return (["### Reach and hook code", ""] + out) if out else []


def _cost(doc: Mapping[str, Any]) -> List[str]:
    """The cost table: per hook whose cost was measured, its collectives and bytes per training step against
    native's on the same cases (:func:`conformance.reports.cost.cost_table`)."""
    table = cost_table(doc.get("hooks", []))
    if not table:
        return []
    return ["### Cost against native", "", "Per training step and rank, over the cases measured (docs/cost.md).", "",
            *table, ""]


def _reasons(doc: Mapping[str, Any]) -> List[str]:
    """The known failures and skips of the run, one table row per hook, outcome and reason, with the count of
    cases: why a hook's cases did not count against it."""
    rows: Dict[Tuple[str, str, str], int] = {}
    for case in doc.get("cases", []):
        outcome = case.get("outcome")
        reason = case.get("known_failure_reason") if outcome in ("xfailed", "xpassed") else (
            case.get("skip_reason") if outcome == "skipped" else None)
        if reason:
            key = (case.get("hook") or "", _OUTCOME_WORDS[outcome], " ".join(str(reason).split()))
            rows[key] = rows.get(key, 0) + 1
    if not rows:
        return []
    out = ["### Known failures and skips", "", "| hook | cases | outcome | reason |", "| --- | --- | --- | --- |"]
    order = {hook.get("name"): i for i, hook in enumerate(doc.get("hooks", []))}  # as the verdict table
    for (hook, what, reason), n in sorted(rows.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0])):
        out.append(f"| `{hook}` | {n} | {what} | {reason.replace('|', chr(92) + '|')} |")
    return out + [""]


#: How the reasons table names an outcome.
_OUTCOME_WORDS = {"xfailed": "known failure", "xpassed": "known failure, now passes", "skipped": "skipped"}


def _claim(hook: Mapping[str, Any]) -> str:
    if hook.get("lossy"):
        return "lossy contract"
    dtype = hook.get("reduce_dtype")
    if hook.get("param_dtype"):  # the API reduces in the parameter dtype by default
        claim = "averaging in the parameter dtype" if dtype in (None, "full") else f"reduce_dtype={dtype}"
        return f"{claim}, param_dtype={hook['param_dtype']}"
    return "full-precision averaging" if dtype in (None, "full") else f"reduce_dtype={dtype}"
