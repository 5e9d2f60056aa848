"""Compare two JUnit XML reports of the suite case by case: the outcome per test id, and optionally the messages.

A refactor of the suite must leave every case's outcome as it was. This reads
two reports (``python -m conformance ... --junitxml=FILE``), keys each case by
its test id (``classname::name``), and prints every id whose outcome differs,
every id only one report has, every case whose JUnit properties differ (names,
values and order), and a count per outcome. With ``--messages`` it
also prints each case whose failure or skip message differs (after removing
what changes from run to run by design: the interpreter's path in the re-run
command, and durations), as a unified diff.

Outcomes are pytest's: passed, failed (a failure or an error), skipped, xfailed
and xpassed (strict, which pytest reports as a failure).

Usage::

    python scripts/junit_outcomes.py BEFORE.xml AFTER.xml [--messages] [--subset] [--max-diffs N]

``--subset``: AFTER is a run of some of BEFORE's cases (``-k``); the cases it
did not run are not reported missing.

Exit status: 0 when every outcome and every case's properties are the same (and,
with ``--messages``, every message), 1 otherwise, 2 for a file that cannot be read. Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Dict, Tuple

#: What differs between two runs of the same code, or of code moved between files: the interpreter the
#: re-run command names, where a skip was raised (the checkout's path, the suite test's line), the frames of
#: a rank's traceback (file, line, source and carets; the exception itself stays), log timestamps, timings.
_VOLATILE = (
    (re.compile(r"\S*/bin/python[\d.]* -m conformance"), "PYTHON -m conformance"),
    (re.compile(r"(?m)^\S+\.py:\d+: "), "FILE:LINE: "),
    (re.compile(r'(?m)^( *)File "[^"]*", line \d+, in .*\n(\1 +\S.*\n)?( *[~^]+ *\n)?'), r"\1FRAME\n"),
    (re.compile(r"(?m)^( *FRAME\n)+"), "  FRAMES\n"),
    (re.compile(r"\[[A-Z]\d{4} \d\d:\d\d:\d\d\.\d+ "), "[TIMESTAMP "),
    # The message attribute's count of the lines left to the element text grows with a traceback's frames.
    (re.compile(r"\[\+\d+ more lines; full report in element text\]"), "[+N more lines; full report in element text]"),
    (re.compile(r"\bin \d+(\.\d+)?s\b"), "in Ns"),
)


def read_cases(path: str) -> Dict[str, Tuple[str, str, Tuple[Tuple[str, str], ...]]]:
    """``{test id: (outcome, message, properties)}`` of a JUnit XML report; raises ``OSError`` or ``ET.ParseError``."""
    out: Dict[str, Tuple[str, str, Tuple[Tuple[str, str], ...]]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is None:
                continue
            message = (element.get("message") or "") + "\n" + (element.text or "")
            if tag == "skipped":
                outcome = "xfailed" if element.get("type") == "pytest.xfail" else "skipped"
            else:
                outcome = "xpassed" if "XPASS(strict)" in (element.get("message") or "") else "failed"
            break
        props = tuple((p.get("name"), p.get("value")) for p in case.iter("property"))
        out[f"{case.get('classname')}::{case.get('name')}"] = (outcome, _normalized(message), props)
    return out


def _normalized(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--messages", action="store_true", help="also compare failure and skip messages")
    parser.add_argument("--subset", action="store_true", help="AFTER ran some of BEFORE's cases: compare those")
    parser.add_argument("--max-diffs", type=int, default=20, help="message diffs to print (default 20)")
    args = parser.parse_args(argv)
    try:
        before, after = read_cases(args.before), read_cases(args.after)
    except (OSError, ET.ParseError) as exc:
        print(f"junit_outcomes: cannot read a report: {exc}", file=sys.stderr)
        return 2
    if args.subset:
        before = {test: case for test, case in before.items() if test in after}
    differs = 0
    for test in sorted(set(before) | set(after)):
        if test not in after:
            print(f"only in {args.before}: {test} ({before[test][0]})")
        elif test not in before:
            print(f"only in {args.after}: {test} ({after[test][0]})")
        elif before[test][0] != after[test][0]:
            print(f"outcome {before[test][0]} -> {after[test][0]}: {test}")
        elif before[test][2] != after[test][2]:
            print(f"properties {before[test][2]} -> {after[test][2]}: {test}")
        else:
            continue
        differs += 1
    changed = []
    if args.messages:
        changed = [t for t in sorted(set(before) & set(after)) if before[t][1] != after[t][1]]
        for test in changed[:args.max_diffs]:
            print(f"\nmessage of {test}:")
            sys.stdout.writelines(difflib.unified_diff(before[test][1].splitlines(True), after[test][1].splitlines(True),
                                                       "before", "after", n=0))
            print()
        if len(changed) > args.max_diffs:
            print(f"... and {len(changed) - args.max_diffs} more messages differ")
    counts = Counter(outcome for outcome, _, _ in after.values())
    print(f"{len(after)} cases in {args.after}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
          + f"; {differs} case(s) differ in outcome or properties from {args.before}"
          + (f"; {len(changed)} message(s) differ" if args.messages else ""))
    return 1 if differs or changed else 0


if __name__ == "__main__":
    sys.exit(main())
