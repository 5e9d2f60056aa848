"""A first night's known failures, drafted: a red run with no baseline writes what a ``--known-failures`` file
would need to make each of its failures expected, every reason a placeholder for the user to write.

A nightly gate starts from its first run. Where that run is red and becomes the baseline as it is, its failures
never fail the gate again and nothing asks why they fail. So a run that failed and was given no ``--baseline``
writes ``known-failures-draft.toml`` beside its reports (:func:`write_draft`): one ``[[failure]]`` entry per
failed case, pinned to the case's exact id, this torch, backend and device, each reason ``TODO: ...`` naming the
failure's diagnosis (its named cause, else its first line). The file loads as it is
(:func:`conformance.controller.known_failures.load_known_failures`), so a user who passes it unread gets every
failure excused with a reason that says TODO; ``docs/nightly.md``'s first-night recipe says to review it, and
:func:`unexplained_in_baseline` is what ``--baseline`` says of a red baseline. Plain data; written as the
reports are.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable, List, Mapping, Optional, Sequence

from conformance.shared.files import write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from conformance.reports.results import CaseRecord

__all__ = ["DRAFT_NAME", "draft_text", "unexplained_in_baseline", "write_draft"]

#: The draft's file name, beside the run's first report.
DRAFT_NAME = "known-failures-draft.toml"
#: The outcomes of a case the draft writes an entry for.
FAILED = ("failed", "error")


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are TOML's for these characters)."""
    return json.dumps(text, ensure_ascii=False)


def _diagnosis(record: CaseRecord) -> str:
    """What the case's failure says first: its named causes, else its header, else its message's first line."""
    failure = getattr(record, "failure", None) or {}
    causes = [c for c in failure.get("causes") or () if c]
    if causes:
        return "; or ".join(causes)
    for text in (failure.get("header"), failure.get("message"), getattr(record, "message", None)):
        line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
        if line:
            return line
    return "no diagnosis recorded"


def draft_text(records: Iterable[Any], environment: Mapping[str, Any], when: str) -> Optional[str]:
    """The draft's TOML for the failed (or errored) case records, or ``None`` where none failed.

    Each entry: ``hook``, ``test`` (the case's exact id; known-failures patterns take ``*`` as the only wildcard),
    ``torch`` (``==`` this torch's release), ``backend`` and ``device`` of the run, and ``reason = "TODO: ..."``
    with the failure's diagnosis. ``environment`` is the results document's; ``when``: the run's start, for the
    header."""
    failed = [r for r in records if getattr(r, "outcome", None) in FAILED and getattr(r, "hook", None)]
    if not failed:
        return None
    version = str(environment.get("torch_version", "")).split("+", 1)[0]
    lines = [
        f"# Known-failures draft: {len(failed)} failed case(s) of a run with no --baseline ({when}).",
        "# REVIEW EVERY ENTRY before passing this file to --known-failures: an entry makes its case an expected",
        "# failure (XFAIL) for as long as it matches. Write in each reason why the case fails and why that is",
        "# acceptable (a PyTorch bug, a documented approximation); delete the entry of a failure that is a bug",
        "# to fix. A reason left as TODO excuses a failure nobody explained. Format: docs/nightly.md.",
        "",
    ]
    for record in failed:
        lines += ["[[failure]]",
                  f"hook = {_toml_string(record.hook)}",
                  f"test = [{_toml_string(record.name)}]"]
        if version:
            lines.append(f"torch = {_toml_string('==' + version)}")
        for key in ("backend", "device"):
            if environment.get(key):
                lines.append(f"{key} = {_toml_string(str(environment[key]))}")
        lines += [f"reason = {_toml_string('TODO, review: ' + _diagnosis(record))}", ""]
    return "\n".join(lines)


def write_draft(directory: str, text: str) -> str:
    """Write ``text`` to :data:`DRAFT_NAME` in ``directory`` as the reports are written
    (:func:`conformance.shared.files.write_atomic`) and return its path.

    Raises:
        OSError: the directory cannot be written.
    """
    path = os.path.join(directory, DRAFT_NAME)
    write_atomic(path, text)
    return path


def unexplained_in_baseline(baseline: Mapping[str, Any]) -> List[str]:
    """The cases a ``--baseline`` document holds as failed (or errored): each a failure that no known-failures
    entry explained when it ran (an explained one is ``xfailed``), and that the gate, measuring against that
    baseline, will never report again."""
    return [c.get("name", "?") for c in baseline.get("cases") or () if c.get("outcome") in FAILED]


def baseline_note(path: str, unexplained: Sequence[str]) -> Optional[str]:
    """What ``--baseline PATH`` says, once, of a baseline with ``unexplained`` failures, or ``None``."""
    if not unexplained:
        return None
    return (f"the baseline {path} holds {len(unexplained)} failed case(s) that no known-failures entry explains; "
            "measured against it, they never fail the gate again, and nothing records why they fail. Explain each "
            "in a --known-failures file (a red run with no --baseline writes a draft, "
            f"{DRAFT_NAME}, beside its reports), or fix it (docs/nightly.md, 'The first night')")
