"""What measuring which of a hook's own code ran costs: a user hook's default run with ``--hook-coverage on`` and
``off``, back to back, alternating, and the overhead of the first over the second.

Issue 44 asks that the measurement (coverage.py's tracer, started for each call of the hook's code and stopped
after it: ``conformance/ranks/hook_code.py``) cost at most 15 % of a user hook's default run. The hooks timed are
README's example (``conformance.examples.my_specs:SPEC``, an FSDP1 hook) and a DDP hook with branches of its own
from the switch zoo (``tests.zoo.switch_hooks``), each in a run of its own: what ``conform --hook ...`` runs.
Each run's pytest time is read from its closing line (the interpreter's start-up is not the measurement's), and
its CPU time (controller, zygote and ranks) from the children's resource usage. This machine's speed varies by
the hour and from one run to the next by up to half: the figure is the fastest run of each against the other
(the least disturbed), with the medians beside it.

Usage::

    python benchmarks/hook_coverage.py [--repeat 4] [--hook MODULE:ATTR ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The user hooks timed by default: README's FSDP1 example, and a DDP hook with switches of its own.
DEFAULT_HOOKS = ("conformance.examples.my_specs:SPEC", "tests.zoo.switch_hooks.ddp:KNOWN_GOOD")


def one_run(hook: str, coverage: str) -> Dict[str, Any]:
    """``python -m conformance -q --hook HOOK --hook-coverage COVERAGE``: pytest's seconds, wall seconds, exit code
    and closing line."""
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "conformance", "-q", "-p", "no:cacheprovider", "--hook", hook,
                               "--hook-coverage", coverage, "--junitxml", os.path.join(tmp, "run.xml")],
                              cwd=_REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    closing = re.findall(r"^=* ?(\d+ \w+(?:, \d+ \w+)*) in ([\d.]+)s", proc.stdout, re.M)
    summary, seconds = closing[-1] if closing else ("(no closing line)", "nan")
    return {"hook": hook, "coverage": coverage, "pytest_s": float(seconds), "wall_s": wall, "cpu_s": cpu,
            "returncode": proc.returncode, "summary": summary}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="runs of each hook with and without (default: 4)")
    parser.add_argument("--hook", action="append", help=f"hook specs to time (default: {', '.join(DEFAULT_HOOKS)})")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures: Dict[str, Any] = {"cpus": os.cpu_count(), "hooks": {}}
    for hook in args.hook or DEFAULT_HOOKS:
        runs = []
        for _ in range(args.repeat):  # alternating, so that the machine's drift falls on both alike
            runs += [one_run(hook, "on"), one_run(hook, "off")]
        on = [r["pytest_s"] for r in runs if r["coverage"] == "on"]
        off = [r["pytest_s"] for r in runs if r["coverage"] == "off"]
        on_cpu = [r["cpu_s"] for r in runs if r["coverage"] == "on"]
        off_cpu = [r["cpu_s"] for r in runs if r["coverage"] == "off"]
        figures["hooks"][hook] = {"runs": runs, "on_min_s": min(on), "off_min_s": min(off),
                                  "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
                                  "overhead": min(on) / min(off) - 1,
                                  "cpu_overhead": min(on_cpu) / min(off_cpu) - 1}
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"machine: {figures['cpus']} CPUs")
        for hook, f in figures["hooks"].items():
            for r in f["runs"]:
                print(f"  {hook} --hook-coverage {r['coverage']:<3}: {r['pytest_s']:.1f} s in pytest "
                      f"({r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s of CPU), exit {r['returncode']}: {r['summary']}")
            print(f"{hook}: fastest {f['on_min_s']:.1f} s measured against {f['off_min_s']:.1f} s not: "
                  f"{100 * f['overhead']:+.1f} % (CPU time, least of each: {100 * f['cpu_overhead']:+.1f} %; "
                  f"medians {f['on_median_s']:.1f} s and {f['off_median_s']:.1f} s)")
    ok = all(r["returncode"] == 0 for f in figures["hooks"].values() for r in f["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
