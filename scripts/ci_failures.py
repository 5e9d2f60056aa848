"""After a red ``make conform`` in CI: print, last, what each failed or NOT RUN case and each re-run crash said.

CI keeps only the tail of a job's output, which is the suite's summary; the reasons (a rank's traceback, what
it printed before it died) are in the results file. This prints them from there, each cut to
``--max-chars``, so the next red run says why without the files.

Usage: python scripts/ci_failures.py reports/conformance.json [--max-chars 4000]
"""

from __future__ import annotations

import argparse
import json
import sys


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit // 2]}\n... {len(text) - limit} characters cut ...\n" \
                                           f"{text[-limit // 2:]}"


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="the run's --json file")
    parser.add_argument("--max-chars", type=int, default=4000, help="characters kept of each case's text")
    args = parser.parse_args(argv)
    try:
        with open(args.results) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"ci: no results to show ({args.results}: {exc})")
        return 0
    for case in doc.get("cases", []):
        failure = case.get("failure") or {}
        skip = case.get("skip_reason") or ""
        if case.get("outcome") in ("failed", "error"):
            text = failure.get("message") or ""
        elif skip.startswith("NOT RUN"):
            text = skip
        else:
            continue
        print(f"ci: {case.get('outcome')} {case.get('id')}\n{_cut(text, args.max_chars)}\n")
    for rerun in (doc.get("run") or {}).get("crash_reruns") or []:
        print(f"ci: a rank died in {rerun['case']} and the case ran once more (the second run "
              f"{rerun['second_run']}); the first run:\n{_cut(rerun['first_run'], args.max_chars)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
