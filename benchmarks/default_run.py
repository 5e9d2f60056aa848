"""Wall time of the default ``make conform`` run, and of starting its pools, as a user feels them.

Two figures, measured on this machine in one invocation:

* **pool start-up**: the pools of the default CPU run (world sizes 2, 3 and 4)
  launched together and waited for, as the session's ``prestart`` does; once
  with ranks forked from the zygote (``conformance/ranks/zygote.py``, the default) and
  once with every rank a fresh interpreter (``CONFORM_FORK_RANKS=0``);
* **default run**: ``python -m conformance -q`` (what ``make conform`` runs,
  after setup), wall time from the command's start to its exit, with its case
  count, ``--repeat`` times; the median is the figure README quotes.

Usage::

    python benchmarks/default_run.py [--repeat 1] [--skip-run] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

#: The world sizes the default CPU run starts pools for (main, extra, HSDP/subgroups).
DEFAULT_WORLD_SIZES = (2, 3, 4)


def pool_startup_s(fork: bool) -> float:
    """Seconds to launch and join the default run's pools together (then closed again)."""
    from conformance.controller import local_pool as pool_mod
    from conformance.controller import zygote_client
    from conformance.controller.pools import PoolConfig

    os.environ["CONFORM_FORK_RANKS"] = "1" if fork else "0"
    zygote_client.close_zygote()
    pools = [pool_mod.RankPool(PoolConfig(world_size=ws, backend="gloo", device="cpu"))
             for ws in DEFAULT_WORLD_SIZES]
    started = time.perf_counter()
    try:
        for p in pools:
            p.launch()
        for p in pools:
            p.wait_ready()
        return time.perf_counter() - started
    finally:
        for p in pools:
            p.close()
        zygote_client.close_zygote()
        os.environ.pop("CONFORM_FORK_RANKS", None)


def default_run() -> Dict[str, Any]:
    """One ``python -m conformance -q`` run: wall seconds, exit code, and pytest's summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "conformance", "-q", "-p", "no:cacheprovider",
                               "--junitxml", os.path.join(tmp, "run.xml")],
                              cwd=_REPO, capture_output=True, text=True)
        wall = time.perf_counter() - started
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ passed", ln)]
    summary = lines[-1].strip("= ") if lines else "(no summary line)"
    cases = sum(int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|error)", summary))
    return {"wall_s": wall, "returncode": proc.returncode, "summary": summary, "cases": cases}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="default runs to time (default: 1)")
    parser.add_argument("--skip-run", action="store_true", help="only the pool start-up figures")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)

    figures: Dict[str, Any] = {
        "cpus": os.cpu_count(),
        "startup_forked_s": pool_startup_s(fork=True),
        "startup_fresh_s": pool_startup_s(fork=False),
    }
    runs = [] if args.skip_run else [default_run() for _ in range(args.repeat)]
    if runs:
        figures["runs"] = runs
        figures["default_run_median_s"] = statistics.median(r["wall_s"] for r in runs)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    sizes = ", ".join(map(str, DEFAULT_WORLD_SIZES))
    print(f"machine: {figures['cpus']} CPUs")
    print(f"pool start-up, world sizes {sizes} together, ranks forked from the zygote: "
          f"{figures['startup_forked_s']:.1f} s")
    print(f"pool start-up, world sizes {sizes} together, every rank a fresh interpreter: "
          f"{figures['startup_fresh_s']:.1f} s")
    for r in runs:
        print(f"default run (python -m conformance -q): {r['wall_s']:.1f} s wall, exit {r['returncode']}, "
              f"{r['cases']} cases: {r['summary']}")
    if runs:
        print(f"default run, median of {len(runs)}: {figures['default_run_median_s']:.1f} s")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
