"""What measuring a hook's cost costs: the meter's own time over a default run, against the run's time.

Issue 47 asks that measuring each case's cost (``conformance/ranks/cost.py``: a wall-clock window around each
measured training step, then one read of PyTorch's flight recorder per case and the counting of its entries) cost
at most 5 % of the default run. Every measured case carries the meter's own time on its slowest rank
(``cases[].cost.meter_ms``: the ranks measure side by side, so the slowest is what the case waits for). This
script runs the default run (``python -m conformance -q --json``, what ``make conform`` runs), or reads the
results of one (``--from PATH``), and prints the meter's total against the run's duration. The windows
themselves are two ``time.time_ns()`` calls a step, nothing beside a read.

Usage::

    python benchmarks/cost_meter.py [--from reports/conformance.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Issue 47's ceiling: the meter's share of the default run.
GOAL = 0.05


def default_run(path: str) -> int:
    """Run the default run with its results written to ``path``; its exit status."""
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "conformance", "-q", "-p", "no:cacheprovider", "--json", path],
                          cwd=_REPO, env=env, stdout=subprocess.DEVNULL).returncode


def figures(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The meter's total, the run's duration and the share, from a results document."""
    meters = [float(c["cost"]["meter_ms"]) for c in doc.get("cases", ())
              if isinstance(c.get("cost"), dict) and "meter_ms" in c["cost"]]
    lost = sum(1 for c in doc.get("cases", ()) if isinstance(c.get("cost"), dict) and "not_measured" in c["cost"])
    run_s = float(doc["run"]["duration_s"])
    meter_s = sum(meters) / 1e3
    return {"cases_measured": len(meters), "cases_not_measured": lost, "meter_s": round(meter_s, 3),
            "run_s": round(run_s, 1), "share": meter_s / run_s if run_s else None,
            "median_case_ms": sorted(meters)[len(meters) // 2] if meters else None,
            "max_case_ms": max(meters) if meters else None}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a default run's --json results (default: run one now)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    if args.source:
        with open(args.source, encoding="utf-8") as f:
            doc = json.load(f)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.json")
            status = default_run(path)
            if not os.path.exists(path):
                print(f"the default run wrote no results (exit status {status})", file=sys.stderr)
                return 2
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
    out = figures(doc)
    share = out["share"]
    print(f"cases measured: {out['cases_measured']} (not measured: {out['cases_not_measured']})")
    print(f"meter's own time: {out['meter_s']:.2f} s over the run (median {out['median_case_ms']} ms a case, "
          f"max {out['max_case_ms']} ms)")
    print(f"default run: {out['run_s']:.1f} s; the meter's share: {share:.2%} (goal: at most {GOAL:.0%})"
          if share is not None else "default run: no duration")
    if share is not None and share > GOAL:
        print("over the goal: the recorder's ring is read once per case; its size (TORCH_FR_BUFFER_SIZE, 256 by "
              "default in the ranks) sets the read's time")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
