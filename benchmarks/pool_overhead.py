"""Per-case time of the rank pool versus spawn-per-case, on a sample of the default run's own cases.

One invocation, one machine, the same cases both ways:

* **the sample**: pytest collects the default run (``python -m conformance``:
  PyTorch's built-in hooks, this machine's world sizes) exactly as ``make
  conform`` does. Of its cases that run to a pass, ``--sample`` (20) are drawn
  with a fixed ``--seed``, stratified by hook API and world size
  (``case_sample.py``). Skips and known failures are left out: a skip never
  reaches a rank, and a known failure stops at its first error (here mostly
  PyTorch's fp16/bf16 hooks, which raise or are refused on a CPU build), so
  timing them would shorten the pool's cases and flatter the ratio.
* **pool**: the sample runs as the suite runs it, in one pytest session, through
  the ``conform`` fixture's ``Runner`` and its rank pools (started before the
  first case, ranks forked from the zygote). One warm-up pass, then
  ``--repeat`` (3) timed passes. A case's pool time is the wall time of its test
  call (``Runner.run_case`` end to end: dispatch, every rank's check, the verdict),
  its median over the timed passes.
* **spawn-per-case**: what PyTorch's ``MultiProcessTestCase`` does for every
  test. Right after a case's last pool pass,
  ``torch.multiprocessing.start_processes(start_method="spawn")`` starts
  ``world_size`` fresh interpreters. Each imports torch, joins a gloo group
  through a ``FileStore`` in a fresh temporary directory, runs the very
  ``Case`` messages the pool ran for that test (same rank check, same params,
  captured at ``RankPool.run``), destroys the group and exits. Its time runs
  from starting the processes until every one is joined.

Printed: the sample's case ids with both times, the median per case each way
over the sample, their ratio, and the same for the per-case overhead (wall time
minus the check's own compute: the slowest rank's time inside the check
function, summed over the case's dispatches). A fresh process runs the check
cold, so spawn's compute is larger than the pool's.

Usage::

    python benchmarks/pool_overhead.py [--sample 20] [--seed 10] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any, Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _path in (_REPO, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# A spawned rank re-imports this module (as __mp_main__), as it would a MultiProcessTestCase
# test module: keep its top level to what such a module imports, torch and the suite's messages.
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

from conformance.protocol import Case, as_check_result  # noqa: E402
from conformance.ranks.worker import RankContext  # noqa: E402

SAMPLE_SIZE = 20
SEED = 10
TIMED_PASSES = 3
#: Issue 10's goal for the pool: at least this many times faster per case than spawn-per-case.
GOAL_RATIO = 20.0
SPAWN_CASE_TIMEOUT_S = 300.0
#: Spawned cases that may crash (and be re-run) before the benchmark gives up.
MAX_SPAWN_CRASHES = 3


# -- spawn-per-case ----------------------------------------------------------------------

def _spawn_rank(rank: int, world_size: int, store_path: str, out_dir: str, cases: List[Case]) -> None:
    """Entry point of one freshly spawned rank (module level, so spawn can pickle it)."""
    stamps = {"entered": time.time()}
    record: Dict[str, Any] = {"rank": rank, "findings": [], "compute_s": 0.0}
    # Like a pool rank: output to its own log, its rank in the environment, one torch thread.
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["CONFORM_RANK"] = str(rank)
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=SPAWN_CASE_TIMEOUT_S))
        stamps["joined"] = time.time()
        from conformance.ranks.checks import get_rank_check
        from conformance.shared.spec_loading import load_target

        ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"), "gloo")
        specs = {case.hook: next(s for s in load_target(case.hook.target) if s.name == case.hook.name)
                 for case in cases if case.hook is not None}
        checks = {case.check: get_rank_check(case.check) for case in cases}
        stamps["loaded"] = time.time()
        for case in cases:
            start = time.perf_counter()
            value = as_check_result(checks[case.check](ctx, specs.get(case.hook), **case.params))
            record["compute_s"] += time.perf_counter() - start
            record["findings"] += [f.describe() for f in value.findings]
        stamps["computed"] = time.time()
        dist.destroy_process_group()
        stamps["destroyed"] = time.time()
    except BaseException:
        record["error"] = traceback.format_exc()
        raise
    finally:
        record["stamps"] = stamps
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(record, f)


class SpawnCaseCrashed(RuntimeError):
    """A spawned rank died, raised or hung before finishing its case (the case is re-run)."""


def spawn_case(cases: List[Case], world_size: int) -> Dict[str, Any]:
    """Run one test's ``cases`` on ``world_size`` fresh spawned processes; its wall time and phases.

    Raises:
        SpawnCaseCrashed: a rank did not finish; the message has its error or log.
    """
    with tempfile.TemporaryDirectory(prefix="commhook-spawn-") as tmpdir:
        store_path = os.path.join(tmpdir, "store")

        def record(rank: int) -> Optional[Dict[str, Any]]:
            try:
                with open(os.path.join(tmpdir, f"rank{rank}.pkl"), "rb") as f:
                    return pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                return None

        def finished(rank: int) -> bool:
            rec = record(rank)
            return rec is not None and "destroyed" in rec["stamps"]

        def why(rank: int) -> str:
            rec = record(rank) or {}
            if rec.get("error"):
                return rec["error"].strip().splitlines()[-1]
            try:
                with open(os.path.join(tmpdir, f"rank{rank}.log")) as f:
                    return f.read()[-1500:] or "(no output)"
            except OSError:
                return "(no log)"

        launched = time.time()
        t0 = time.perf_counter()
        context = tmp.start_processes(_spawn_rank, args=(world_size, store_path, tmpdir, cases),
                                      nprocs=world_size, join=False, start_method="spawn")
        procs = context.processes
        deadline = time.monotonic() + SPAWN_CASE_TIMEOUT_S
        try:
            # Wait on the processes directly: ProcessContext.join would SIGTERM the
            # peers as soon as one rank exits non-zero, even after it finished its case.
            pending = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
            while pending:
                ready = mp_wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
                if not ready:
                    raise SpawnCaseCrashed(f"ranks {sorted(r for r, _ in pending.values())} did not finish "
                                           f"within {SPAWN_CASE_TIMEOUT_S:.0f} s")
                for sentinel in ready:
                    rank, proc = pending.pop(sentinel)
                    proc.join()
                    if proc.exitcode != 0 and not finished(rank):
                        raise SpawnCaseCrashed(f"rank {rank} exited with code {proc.exitcode} before "
                                               f"finishing the case: {why(rank)}")
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        wall = time.perf_counter() - t0
        records = [record(r) for r in range(world_size)]
    exit_codes = [p.exitcode for p in procs]
    if not all(rec is not None and "destroyed" in rec["stamps"] for rec in records):
        raise SpawnCaseCrashed(f"a rank did not finish the case (exit codes {exit_codes})")
    compute = max(rec["compute_s"] for rec in records)

    def latest(key: str) -> float:
        return max(rec["stamps"][key] for rec in records)

    return {
        "wall_s": wall,
        "compute_s": compute,
        "overhead_s": wall - compute,
        # Phases, from the launch to the slowest rank reaching each point.
        "start_import_s": latest("entered") - launched,
        "rendezvous_s": latest("joined") - latest("entered"),
        "load_checks_s": latest("loaded") - latest("joined"),
        "destroy_s": latest("destroyed") - latest("computed"),
        "exit_s": (launched + wall) - latest("destroyed"),
        "findings": [f for rec in records for f in rec["findings"]],
        # Ranks that finished the case, then died on the way out (non-zero exit code).
        "bad_exits": sum(code != 0 for code in exit_codes),
    }


class SpawnRunner:
    """Spawn-per-case for one sampled case at a time, re-running a crashed one (:data:`MAX_SPAWN_CRASHES` in all)."""

    def __init__(self) -> None:
        self.crashes: List[str] = []
        self.done = 0

    def __call__(self, row: Any) -> Optional[Dict[str, Any]]:
        while len(self.crashes) <= MAX_SPAWN_CRASHES:
            try:
                figures = spawn_case(row.cases, row.world_size)
            except SpawnCaseCrashed as exc:
                self.crashes.append(f"{row.name}: {exc}")
                continue
            self.done += 1
            print(f"  {self.done:>3}  pool {row.pool_wall_s * 1e3:8.1f} ms  spawn {figures['wall_s'] * 1e3:8.0f} ms"
                  f"  {row.name}", file=sys.stderr, flush=True)
            return figures
        return None


# -- report ------------------------------------------------------------------------------

def report(session: Any, spawner: SpawnRunner, args: argparse.Namespace, total_s: float,
           load: Sequence[float]) -> Dict[str, Any]:
    rows = [r for r in session.sample if r.spawn is not None]
    pool_med = statistics.median([r.pool_wall_s for r in rows])
    spawn_med = statistics.median([r.spawn["wall_s"] for r in rows])
    pool_ovh = statistics.median([r.pool_overhead_s for r in rows])
    spawn_ovh = statistics.median([r.spawn["overhead_s"] for r in rows])
    pool_compute = statistics.median([r.pool_compute_s for r in rows])
    ratio, ovh_ratio = spawn_med / pool_med, spawn_ovh / pool_ovh
    per_case_ratios = [r.spawn["wall_s"] / r.pool_wall_s for r in rows]
    phases = ("start_import_s", "rendezvous_s", "load_checks_s", "compute_s", "destroy_s", "exit_s")
    phase_meds = {k: statistics.median([r.spawn[k] for r in rows]) for k in phases}

    print()
    print(f"sample: {len(session.sample)} of the default run's {sum(session.population.values())} passing cases "
          f"({sum(session.collected.values())} collected; "
          + ", ".join(f"{n} {k}" for k, n in sorted(session.collected.items()) if k != "passing")
          + f" left out), seed {args.seed}, stratified by API and world size:")
    drawn: Dict[tuple, int] = {}
    for r in session.sample:
        drawn[(r.api, r.world_size)] = drawn.get((r.api, r.world_size), 0) + 1
    print("  " + ", ".join(f"{api} ws{ws}: {drawn.get((api, ws), 0)} of {n}"
                           for (api, ws), n in sorted(session.population.items())))
    print()
    for r in session.sample:
        if r.skipped is not None:
            print(f"  left out, skipped when it ran: {r.name}: {r.skipped[:200]}")
    print(f"{'pool (ms)':>10} {'spawn (ms)':>11} {'ratio':>6}  case (pool: median of {args.repeat} warm passes; "
          "spawn: one run)")
    for r in rows:
        print(f"{r.pool_wall_s * 1e3:10.1f} {r.spawn['wall_s'] * 1e3:11.0f} {r.spawn['wall_s'] / r.pool_wall_s:5.0f}x"
              f"  {r.name}")
    print()
    met = "met" if ratio >= GOAL_RATIO else "NOT met"
    print(f"median per case, pool:           {pool_med * 1e3:8.1f} ms")
    print(f"median per case, spawn-per-case: {spawn_med * 1e3:8.1f} ms")
    print(f"ratio, spawn-per-case / pool:    {ratio:8.1f}x   (goal: at least {GOAL_RATIO:.0f}x: {met})")
    print(f"  per-case ratios: median {statistics.median(per_case_ratios):.0f}x, min {min(per_case_ratios):.0f}x, "
          f"max {max(per_case_ratios):.0f}x")
    print(f"overhead per case (wall minus the check's own compute), medians: pool {pool_ovh * 1e3:.1f} ms, "
          f"spawn-per-case {spawn_ovh * 1e3:.0f} ms: {ovh_ratio:.0f}x")
    print("spawn-per-case, medians: " + ", ".join(
        f"{label} {phase_meds[k] * 1e3:.0f} ms" for label, k in (
            ("start + import torch", "start_import_s"), ("rendezvous", "rendezvous_s"),
            ("import checks and hooks", "load_checks_s"), ("check (cold)", "compute_s"),
            ("destroy group", "destroy_s"), ("exit + join", "exit_s"))))
    if ratio < GOAL_RATIO:
        print(f"below the {GOAL_RATIO:.0f}x goal: the pool removes the per-case start-up, but the checks' own "
              f"compute is {pool_compute * 1e3:.0f} ms of the pool's {pool_med * 1e3:.0f} ms median case here, "
              f"and that compute is paid both ways; excluding it, the pool's overhead is {ovh_ratio:.0f}x smaller")
    found = [(r.name, f) for r in rows for f in r.spawn["findings"]]
    if found:
        print(f"note: {len(found)} finding(s) in spawn-per-case runs of cases that passed on the pool, "
              f"first: {found[0][0]}: {found[0][1]}")
    bad_exits = sum(r.spawn["bad_exits"] for r in rows)
    if spawner.crashes or bad_exits:
        print(f"spawn-per-case: {len(spawner.crashes)} case run(s) crashed and were re-run; "
              f"{bad_exits} rank(s) finished their case, then exited non-zero")
        for text in spawner.crashes:
            print(f"    {text}")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}, "
          f"gloo on CPU; 1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end; "
          f"benchmark took {total_s:.0f} s")
    return {
        "sample": [{"id": r.nodeid, "api": r.api, "world_size": r.world_size,
                    "pool_wall_s": [w for w, _ in r.timed], "pool_compute_s": [c for _, c in r.timed],
                    "spawn": {k: v for k, v in r.spawn.items() if k != "findings"}} for r in rows],
        "seed": args.seed, "repeat": args.repeat, "collected": session.collected,
        "population": {f"{api} ws{ws}": n for (api, ws), n in session.population.items()},
        "median_pool_s": pool_med, "median_spawn_s": spawn_med, "ratio": ratio, "goal_ratio": GOAL_RATIO,
        "median_overhead_pool_s": pool_ovh, "median_overhead_spawn_s": spawn_ovh, "overhead_ratio": ovh_ratio,
        "spawn_phase_medians_s": phase_meds, "spawn_crashes": spawner.crashes,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_1min": list(load), "total_s": total_s,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=SAMPLE_SIZE, help=f"cases in the sample (default {SAMPLE_SIZE})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the sample's seed (default {SEED})")
    parser.add_argument("--repeat", type=int, default=TIMED_PASSES,
                        help=f"timed pool passes over the sample, after a warm-up pass (default {TIMED_PASSES})")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    if args.sample < 1 or args.repeat < 1:
        parser.error("--sample and --repeat must be at least 1")
    # Both ways alike, as the pool's ranks have them: one OpenMP thread, gloo on loopback.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    from pool_sample import WARMUP_PASSES, SampleSession, run_sample

    print(f"commhook-conformance: per-case time, rank pool vs spawn-per-case, on {args.sample} of the default "
          f"run's cases (pool: {WARMUP_PASSES} warm-up + {args.repeat} timed passes; spawn: once per case)", flush=True)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.perf_counter()
    spawner = SpawnRunner()
    session = SampleSession(args.sample, args.seed, args.repeat, spawn=spawner)
    pytest_output = io.StringIO()
    code = run_sample(session, pytest_output)
    total = time.perf_counter() - t0
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if code != 0 or session.failures:
        print(f"the sample did not run to a pass on the pool (pytest exit code {code}); no figures:", file=sys.stderr)
        for text in session.failures or [pytest_output.getvalue()[-5000:]]:
            print(text, file=sys.stderr)
        return 1
    if len(spawner.crashes) > MAX_SPAWN_CRASHES:
        print("too many spawn-per-case crashes; no figures:\n" + "\n".join(spawner.crashes), file=sys.stderr)
        return 1
    summary = report(session, spawner, args, total, (load_before, load_after))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
