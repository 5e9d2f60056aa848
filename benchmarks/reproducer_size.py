#!/usr/bin/env python3
"""What the reproducer writer's AST work buys a hook author, in lines: the file it writes against simpler writers.

For a parity case of every API in each of its configs (``nested_wrapped``, 4 ranks, one finding at step 0, as
``tests/test_reproducer_content.py`` writes them), this prints the lines of:

* ``written``: the file :func:`conformance.reproducers.writer.reproducer_source` writes: only the definitions the
  case runs, each ``if`` the case decides written as its branch, single-use helpers written at their call;
* ``copied``: what a writer that copies whole modules would hold: every line of the modules the file's code is
  read from (the model's modules, the lock-step loop's pieces, the API's standalone part), less nothing;
* ``suite``: the lines of the ``conformance`` package a writer that imports the suite instead would make the
  author install (the package less its tests' zoo): such a file is short but is no reproducer for a hook author
  without the suite, which is what a reproducer promises (``tests/test_reproducers.py`` runs each beside a
  ``conformance`` that raises on import).

    python benchmarks/reproducer_size.py [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from conformance.apis.controller_side import controller_side  # noqa: E402 - after the repository joins the path
from conformance.models import get_model  # noqa: E402
from conformance.protocol import Finding  # noqa: E402
from conformance.reproducers import writer  # noqa: E402
from conformance.reproducers.parts import model_modules  # noqa: E402
from conformance.shared import standalone_main  # noqa: E402
from tests import test_reproducer_content as content  # noqa: E402


def _lines(module: str) -> int:
    path = importlib.import_module(module).__file__
    with open(path) as f:
        return sum(1 for _ in f)


def _package_lines() -> int:
    total = 0
    for root, _, files in os.walk(os.path.join(REPO, "conformance")):
        total += sum(_lines_of(os.path.join(root, f)) for f in files if f.endswith(".py"))
    return total


def _lines_of(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    rows: List[Dict[str, object]] = []
    cases = {(api, tuple(params.items()), world_size): params for api, params, world_size in content._cases()
             if params.get("model") == "nested_wrapped"}  # each config once
    for (api, _, world_size), params in cases.items():
        module, name = content.HOOKS[api]
        spec = next(s for s in importlib.import_module(module).ALL if s.name == name)
        case_id = f"test_{api}_parity[{name}-{'-'.join(map(str, params.values()))}-ws{world_size}]"
        source = writer.reproducer_source(spec, f"{module}:ALL", f"{api}.parity", params, world_size, case_id,
                                          [Finding(0, "differs", step=0)], "header", "rerun", "/tmp/reproducer.py")
        modules = [*model_modules(get_model(params["model"])), *standalone_main.PIECES,
                   *(m.__name__ for m in controller_side(api).standalone)]
        rows.append({"api": api, "variant": "-".join(str(v) for k, v in params.items() if k != "model"),
                     "written": source.count("\n") + 1, "copied": sum(_lines(m) for m in dict.fromkeys(modules)),
                     "modules": len(dict.fromkeys(modules))})
    suite = _package_lines()
    print(f"{'api':18} {'variant':24} {'written':>8} {'copied':>8} {'modules':>8}")
    for row in rows:
        print(f"{row['api']:18} {row['variant']:24} {row['written']:8} {row['copied']:8} {row['modules']:8}")
    written = [r["written"] for r in rows]
    copied = [r["copied"] for r in rows]
    print(f"{len(rows)} parity files: written {min(written)}-{max(written)} lines; whole modules copied "
          f"{min(copied)}-{max(copied)} lines ({min(c / w for c, w in zip(copied, written)):.1f}x to "
          f"{max(c / w for c, w in zip(copied, written)):.1f}x); importing the suite instead needs its "
          f"{suite} lines installed")
    if args.json:
        print(json.dumps({"rows": rows, "suite_lines": suite}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
