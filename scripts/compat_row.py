"""One row of README's torch compatibility table: ``make compat TORCH=2.11.0``.

Makes (or reuses) a virtualenv with ``torch==TORCH`` and nothing else, runs the
default ``make conform`` in it exactly as a user would, reads the JUnit XML it
wrote, and prints the row: torch (and whether it is a CUDA or CPU build),
Python, cases passed, skipped, xfailed, xpassed and failed, and the exit code.

PyPI's torch builds are CUDA builds of several GB (they run on a CPU-only
machine too), so this is a one-off check, never part of CI.

Usage: ``python scripts/compat_row.py --torch 2.11.0 [--venv DIR]``; the
default venv is ``.compat/torch-TORCH-pyX.Y``. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("passed", "skipped", "xfailed", "xpassed", "failed")


def count_outcomes(junit_path: str) -> Dict[str, int]:
    """Outcome counts of a pytest JUnit XML report (errors count as failed)."""
    counts: Counter = Counter()
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is None:
                continue
            if tag == "skipped":
                outcome = "xfailed" if element.get("type") == "pytest.xfail" else "skipped"
            else:
                outcome = "xpassed" if "XPASS(strict)" in (element.get("message") or "") else "failed"
            break
        counts[outcome] += 1
    return dict(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="the torch release to install, e.g. 2.11.0")
    parser.add_argument("--venv", help="virtualenv to use or create (default: .compat/torch-TORCH-pyX.Y)")
    args = parser.parse_args()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    venv = os.path.abspath(args.venv or os.path.join(REPO, ".compat", f"torch-{args.torch}-py{py}"))
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    have = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
    if have.split("+")[0] != args.torch:
        if have:
            print(f"compat: {venv} holds torch {have}, not {args.torch}; give another --venv", file=sys.stderr)
            return 2
        subprocess.check_call([python, "-m", "pip", "install", "--disable-pip-version-check", f"torch=={args.torch}"])
    reports = os.path.join(venv, "reports")
    started = time.monotonic()
    rc = subprocess.call(["make", "-C", REPO, "conform", f"PYTHON={python}", f"REPORTS={reports}"])
    minutes = (time.monotonic() - started) / 60
    info = subprocess.run([python, "-c", "import sys, torch; print(torch.__version__, "
                           "'CUDA' if torch.version.cuda or getattr(torch.version, 'hip', None) else 'CPU', "
                           "'%d.%d' % sys.version_info[:2])"],
                          stdout=subprocess.PIPE, text=True).stdout.split()
    junit = os.path.join(reports, "conformance.xml")
    counts = count_outcomes(junit) if os.path.exists(junit) else {}
    version, build, pyver = info if len(info) == 3 else (args.torch, "?", py)
    cells = [f"{version} ({build} build)", pyver] + [str(counts.get(c, 0)) for c in COLUMNS] + [str(rc)]
    print(f"\ncompat: make conform took {minutes:.1f} min; README row:")
    print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
