#!/usr/bin/env python3
"""Time to write a standalone reproducer, in this process, without ranks.

Under ``--write-reproducers`` every failed case gets a file (``conformance.reproducers.writer``), and a run that
fails many cases (a zoo run of ``make test``; a user's nightly with a broken hook) writes hundreds, most of them
for case shapes it wrote before, for another hook or step. This writes the parity files of
``tests/test_reproducer_content.py``'s cases (every API, config and model a parity case can have, at 4 ranks) for
two zoo hooks of each API, each failing at step 0 and at step 2, and prints the files written, the time and the
time per file. ``--every N`` takes every Nth case only; ``--digests FILE`` writes each file's SHA-1, to show that a
change of the writer leaves the files as they were (compare two such files).

    python benchmarks/reproducer_writing.py [--every 1] [--digests FILE] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from conformance.protocol import Finding  # noqa: E402 - after the repository joins the path
from conformance.reproducers import writer  # noqa: E402
from tests import test_reproducer_content as content  # noqa: E402

#: A second zoo hook of each API (torch-only modules), beside test_reproducer_content.HOOKS's.
OTHER_HOOKS = {"ddp": ("tests.zoo.ddp_hooks", "bad_sum_no_average"), "fsdp": ("tests.zoo.fsdp_hooks", "bad_divide_after"),
               "fsdp2": ("tests.zoo.fsdp2_comms", "bad_wrong_shard"),
               "fsdp2_all_reduce": ("tests.zoo.fsdp2_comms", "bad_world_average_hook"),
               "fsdp2_replica": ("tests.zoo.fsdp2_comms", "bad_replica_world_divisor")}


def _spec(module: str, name: str):
    return next(s for s in importlib.import_module(module).ALL if s.name == name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=1, help="take every Nth case (default: all)")
    parser.add_argument("--digests", help="write each file's SHA-1 here (JSON)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    cases = content._cases()[::args.every]
    digests = {}
    start = time.perf_counter()
    for api, params, world_size in cases:
        for module, name in (content.HOOKS[api], OTHER_HOOKS[api]):
            for step in (0, 2):
                case_id = f"test_{api}_parity[{name}-{'-'.join(map(str, params.values()))}-ws{world_size}]"
                source = writer.reproducer_source(_spec(module, name), f"{module}:ALL", f"{api}.parity", params,
                                                  world_size, case_id, [Finding(0, "differs", step=step)],
                                                  "header", "rerun", "/tmp/reproducer.py")
                digests[f"{case_id} step {step}"] = hashlib.sha1(source.encode()).hexdigest()
    seconds = time.perf_counter() - start
    print(f"{len(digests)} reproducers ({len(cases)} case shapes x 2 hooks x 2 failing steps) in {seconds:.1f} s: "
          f"{1000 * seconds / len(digests):.0f} ms each")
    if args.digests:
        with open(args.digests, "w") as out:
            json.dump(digests, out, indent=0, sort_keys=True)
    if args.json:
        print(json.dumps({"files": len(digests), "seconds": round(seconds, 3),
                          "ms_per_file": round(1000 * seconds / len(digests), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
