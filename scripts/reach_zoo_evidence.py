#!/usr/bin/env python3
"""The verdicts of ``tests/zoo/reach_hooks/``, established outside the suite: native vs hooked, bit for bit.

For every hook of the reach zoo this trains the same model twice in each rank
process, with gloo on CPU: once natively (DDP with no hook; FSDP1 with no hook;
``fully_shard`` with no custom comm; for a replica hook native HSDP on the
replicas x 2 mesh) and once with the hook (for a replica hook ``fully_shard`` on
the mesh's shard dimension with the hook installed by ``set_all_reduce_hook`` on
every FSDP module). After every backward each rank compares its gradients
(FSDP1: its flat-parameter shards; FSDP2: its local shards) with the native
ones bitwise (NaN equal to NaN); the first step that differs on any rank ends
the run. Runs:

* ``small``: a 2-layer MLP (10 -> 33 -> 5, 533 parameters), 4 steps, one node's
  torchrun environment, at 2 and 3 ranks (replica hooks: 4 ranks, 2 replicas x
  2 shards), and at 4 ranks for the topology hooks: what the suite ran before
  issue 28;
* ``large`` (size hooks): a wide layer and a head, 2 steps, at 2 ranks (replica:
  4). DDP: ``Linear(13, 504125)`` and ``Linear(504125, 1)``, no biases, the default
  bucket cap: buckets of 6,553,625 elements (25.0 MiB) and 504,125 (1.9 MiB).
  FSDP1/FSDP2/replica: ``Linear(13, 322643)`` and ``Linear(322643, 1)``: a flat
  parameter of 4,194,359 elements (FSDP1), a reduce-scatter input of 4,194,372
  (FSDP2 at 2 ranks), a replica tensor of 2,097,186 (2 shards). Lengths are odd
  and no multiple of 3;
* ``long`` (horizon hooks): the small model for ``--long-steps`` steps (256), the
  hook's state fresh at step 0;
* ``2x1``, ``2x2`` (and ``2x4`` with ``--eight``; topology hooks): the small model,
  4 steps, with torchrun's environment for 2 nodes of 1, 2 (or 4) ranks.

The loss is ``((out - target) ** 2).mean()`` against a target uniform in [-1, 1),
inputs and targets drawn from a generator seeded by rank and step: every rank
sees different data, and 2,000 SGD steps stay finite.

Prints one row per hook: the small runs, the run past the hook's threshold
(with the first differing step), and whether that is what the zoo's ``REACH``
says (a bad hook: native on the small runs, differing past its threshold, at the
step ``REACH`` names; a good hook: native everywhere). Exits 1 if any row is not.

What each rank runs (the models, the builds, the training, the jobs of a spawn) is
``scripts/reach_zoo_ranks.py``; this script spawns the ranks and judges their results.

Usage: ``python3 scripts/reach_zoo_evidence.py [--long-steps 256] [--eight] [--apis ddp,fsdp,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # scripts/, for reach_zoo_ranks; the checkout, for tests.zoo

from reach_zoo_ranks import APIS, jobs_for, specs_of, worker  # noqa: E402
from tests.zoo import reach_hooks as zoo  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world_size: int, apis: List[str], long_steps: int, eight: bool, deadline_s: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        ctx = mp.start_processes(worker, args=(world_size, free_port(), apis, long_steps, eight, out),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    raise SystemExit(f"the {world_size}-rank run passed {deadline_s:.0f} s; stopped")
        except mp.ProcessExitedException as exc:
            if not os.path.exists(out):  # died before rank 0 wrote the results
                raise
            print(f"  note: a {world_size}-rank process died after the results were written ({exc})")
        with open(out) as f:
            return json.load(f)


# -- the table --------------------------------------------------------------------------------------------------


def cell(result: Optional[Dict[str, Any]]) -> str:
    if result is None:
        return "-"
    if result.get("error"):
        return "raised"
    if result["first"] is None:
        return f"native({result['steps']})"
    return f"differs@{result['first']} ({result['max_abs']:.1e})"


def threshold_text(name: str) -> str:
    reach = zoo.REACH[name]
    if reach["axis"] == "size":
        relation = ">" if "chunked" in name else ">="  # a chunk loop starts above its threshold
        return f"{reach['buffer']} {relation} 2**{reach['numel'].bit_length() - 1}"
    if reach["axis"] == "horizon":
        return f"step {reach['first_step']}"
    return "multi-node" if not reach["layouts"] else "on " + ",".join(reach["layouts"])


def verdict(spec: Any, api: str, results: Dict[str, Any], long_steps: int,
            eight: bool) -> Tuple[str, List[Tuple[str, Any]]]:
    """("OK" or why not, the past-threshold cells) of ``spec`` trained under ``api``."""
    name = spec.name
    reach = zoo.REACH[name]
    good = name.startswith("good_")
    replica = api == "fsdp2_replica"
    small_keys = [f"{name}|{api}|small-noenv|ws{4 if replica else 2}"]
    small_keys += [f"{name}|{api}|small|ws{ws}" for ws in ((4,) if replica else (2, 3))]
    if reach["axis"] == "topology" and not replica:
        small_keys.append(f"{name}|{api}|small|ws4")
    problems = []
    for key in small_keys:
        r = results.get(key)
        if r is None or r.get("error") or r["first"] is not None:
            problems.append(f"not native on {key.split('|', 1)[1]}")
    past: List[Tuple[str, Any]] = []
    if reach["axis"] == "size":
        for ws in ((4,) if replica else (2, 3)):
            past.append((f"large ws{ws}", results.get(f"{name}|{api}|large|ws{ws}")))
    elif reach["axis"] == "horizon":
        past.append((f"long {long_steps}", results.get(f"{name}|{api}|long|ws{4 if replica else 2}")))
    else:
        layouts = ([] if replica else [("2x1", 2)]) + [("2x2", 4)] + ([("2x4", 8)] if eight else [])
        for layout, ws in layouts:
            past.append((layout, results.get(f"{name}|{api}|{layout}|ws{ws}")))
    for label, r in past:
        if r is None:
            problems.append(f"{label}: no result")
            continue
        if r.get("error"):
            problems.append(f"{label}: raised {r['error']}")
            continue
        differs = r["first"] is not None
        if reach["axis"] == "topology":
            expected = not good and label in reach["layouts"]
        else:
            expected = not good
        if differs != expected:
            problems.append(f"{label}: {'differs' if differs else 'native'}, "
                            f"expected {'differs' if expected else 'native'}")
        elif differs and reach["axis"] == "horizon" and r["first"] != reach["first_step"]:
            problems.append(f"{label}: first differs at {r['first']}, REACH says {reach['first_step']}")
    return ("OK" if not problems else "; ".join(problems)), past


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-steps", type=int, default=256)
    parser.add_argument("--eight", action="store_true", help="also 8 ranks as 2 nodes of 4 (topology hooks)")
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--deadline", type=float, default=900, help="seconds per spawn before it is stopped")
    args = parser.parse_args()
    apis = [a for a in args.apis.split(",") if a]
    print(f"torch {torch.__version__}, gloo on CPU, {os.cpu_count()} CPUs; long run {args.long_steps} steps")
    results: Dict[str, Any] = {}
    sizes = [2, 3, 4] + ([8] if args.eight else [])
    for ws in sizes:
        if not any(jobs_for(ws, apis, args.long_steps, args.eight)):
            continue
        started = time.perf_counter()
        results.update(spawn(ws, apis, args.long_steps, args.eight, args.deadline))
        print(f"  {ws} ranks: {time.perf_counter() - started:.1f} s")
    print("buffer elements a hook gets from the large model (distinct, 2 steps):")
    for key, numels in sorted(results.items()):
        if key.startswith("buffers|"):
            _, api, ws = key.split("|")
            print(f"  {api} at {ws[2:]} ranks: " + ", ".join(f"{n:,}" for n in numels))
    results = {k: v for k, v in results.items() if not k.startswith("buffers|")}
    rows = []
    bad_rows = 0
    for api in apis:
        for spec in specs_of(api):
            name = spec.name
            reach = zoo.REACH[name]
            replica = api == "fsdp2_replica"
            smalls = [cell(results.get(f"{name}|{api}|small-noenv|ws{4 if replica else 2}"))]
            smalls += [cell(results.get(f"{name}|{api}|small|ws{ws}")) for ws in ((4,) if replica else (2, 3))]
            if reach["axis"] == "topology" and not replica:
                smalls.append(cell(results.get(f"{name}|{api}|small|ws4")))
            ok, past = verdict(spec, api, results, args.long_steps, args.eight)
            bad_rows += ok != "OK"
            rows.append((name, api, reach["axis"], threshold_text(name), " ".join(smalls),
                         "  ".join(f"{label}: {cell(r)}" for label, r in past), ok))
    headers = ("hook", "api", "axis", "threshold", "small: no env, 1 node (ws 2; 2 3 [4]; replica 4; 4)",
               "past the threshold",
               "as REACH says")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    errors = {k: v["error"] for k, v in results.items() if v.get("error")}
    for key, error in errors.items():
        print(f"raised: {key}: {error}")
    print(f"{len(rows) - bad_rows} of {len(rows)} hooks as REACH says")
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
