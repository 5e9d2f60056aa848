#!/usr/bin/env python3
"""The floor under every check: the time of one small gloo collective on this machine.

Each check trains two copies of a model, and FSDP, FSDP2 and DDP issue two or three collectives per
FSDP unit (or bucket) per model per step; on a machine where a collective waits on a sleeping CPU to
wake, that wait, not the suite, is most of a case. This starts ``world_size`` CPU processes (forked,
one thread each, as the suite's ranks), joins them in a gloo group through a ``FileStore``, and times
``--calls`` back-to-back calls of each collective on small float32 tensors after 50 warm-up calls.
Prints microseconds per call on rank 0, for each world size.

    python benchmarks/collective_latency.py [--world-sizes 2 3] [--calls 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: (name, elements): what FSDP2's smallest units and the suite's own agreement send.
COLLECTIVES = (("all_reduce", 1), ("all_reduce", 8), ("all_gather_into_tensor", 8), ("reduce_scatter_tensor", 8))


def _rank(rank: int, world_size: int, store_path: str, calls: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    figures: Dict[str, float] = {}
    for name, numel in COLLECTIVES:
        x = torch.ones(numel * (world_size if name == "reduce_scatter_tensor" else 1))
        out = torch.empty(numel * world_size if name == "all_gather_into_tensor" else numel)
        # torch 2.13 names them all_gather_single and reduce_scatter_single (what FSDP2 calls); older ones do not
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        call = {"all_reduce": lambda: dist.all_reduce(x), "all_gather_into_tensor": lambda: gather(out, x),
                "reduce_scatter_tensor": lambda: scatter(out, x)}[name]
        for _ in range(50):
            call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        figures[f"{name} of {numel}"] = (time.perf_counter() - start) / calls * 1e6
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(figures, f)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    results: Dict[int, Dict[str, float]] = {}
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory(prefix="commhook-latency-") as tmp:
            out_path = os.path.join(tmp, "rank0.json")
            mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "store"), args.calls, out_path),
                               nprocs=world_size, start_method="fork")
            with open(out_path) as f:
                results[world_size] = json.load(f)
        for what, us in results[world_size].items():
            print(f"{world_size} ranks  {what:<28} {us:8.0f} us a call")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo on CPU; "
          f"1-min load average {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({str(k): v for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
