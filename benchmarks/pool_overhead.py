"""Per-case cost of the rank pool versus spawning fresh processes for every case.

Two ways to run the same conformance case (same rank check, same hook, same
parameters, same machine, one invocation of this script):

* **pool**: one :class:`conformance.pool.RankPool` started once; every case is
  sent to the persistent ranks over their socket pairs. Per-case overhead is the
  controller's wall time for ``pool.run(case)`` minus the case's own compute
  (the slowest rank's ``RankOutcome.compute_s``). Pool start-up is reported
  separately: a session pays it once per world size.
* **spawn-per-case**: what PyTorch's ``MultiProcessTestCase`` does for every
  test. ``torch.multiprocessing.start_processes(start_method="spawn")`` starts
  ``world_size`` fresh interpreters; each imports torch, joins a gloo process
  group through a ``FileStore`` in a fresh temporary file, runs the same rank
  check function, destroys the group and exits.

Usage::

    python benchmarks/pool_overhead.py [--world-size 2] [--cases 40] [--spawn-cases 5]
                                       [--check averaging|parity|both] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any, Dict, List, Optional, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402  (a MultiProcessTestCase module imports torch too)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

from conformance.protocol import Case, HookRef  # noqa: E402
from conformance.worker import RankContext  # noqa: E402

HOOK_TARGET = "conformance.builtin_hooks.fsdp:FSDP_HOOKS"
HOOK_NAME = "allreduce_hook"
#: Cases used as workloads; both are real suite cases for PyTorch's allreduce_hook.
CASES: Dict[str, Case] = {
    "averaging": Case(check="fsdp.averaging", hook=HookRef(HOOK_TARGET, HOOK_NAME),
                      params={"strategy": "NO_SHARD"},
                      case_id="allreduce_hook-NO_SHARD-analytic_linear"),
    "parity": Case(check="fsdp.parity", hook=HookRef(HOOK_TARGET, HOOK_NAME),
                   params={"strategy": "NO_SHARD", "model": "net_wrapped"},
                   case_id="allreduce_hook-NO_SHARD-net_wrapped"),
}
#: Short labels for the table.
LABELS = {"averaging": "averaging (analytic_linear)", "parity": "parity (net_wrapped)"}
WARMUP_CASES = 2
SPAWN_CASE_TIMEOUT_S = 180.0
#: Spawned cases that may crash (and be retried) before the benchmark gives up.
MAX_SPAWN_CRASHES = 3


# -- statistics ------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of a non-empty sequence."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "min": min(values),
        "max": max(values),
    }


def _findings_text(value: Any) -> str:
    if isinstance(value, list) and value:
        first = value[0]
        return f"{len(value)} finding(s), first: {getattr(first, 'describe', lambda: repr(first))()}"
    return repr(value)


# -- pool mode ---------------------------------------------------------------------------

def bench_pool(names: Sequence[str], world_size: int, n_cases: int) -> Dict[str, Any]:
    from conformance.pool import PoolConfig, RankPool

    pool = RankPool(PoolConfig(world_size=world_size, backend="gloo", device="cpu"))
    out: Dict[str, Any] = {"cases": {}}
    try:
        t0 = time.perf_counter()
        pool.start()
        out["startup_s"] = time.perf_counter() - t0
        for name in names:
            case = CASES[name]
            warm = []
            for _ in range(WARMUP_CASES):
                t = time.perf_counter()
                result = _checked_pool_run(pool, case)
                warm.append((time.perf_counter() - t, result.max_compute_s))
            walls, computes, overheads, inner = [], [], [], []
            for _ in range(n_cases):
                t = time.perf_counter()
                result = _checked_pool_run(pool, case)
                wall = time.perf_counter() - t
                walls.append(wall)
                computes.append(result.max_compute_s)
                overheads.append(wall - result.max_compute_s)
                inner.append(result.wall_s)
            out["cases"][name] = {"wall_s": walls, "compute_s": computes, "overhead_s": overheads,
                                  "pool_wall_s": inner, "first_wall_s": warm[0][0],
                                  "first_compute_s": warm[0][1]}
        out["pool_starts"] = pool.starts
    finally:
        pool.close()
    return out


def _checked_pool_run(pool: Any, case: Case) -> Any:
    result = pool.run(case)
    if not result.all_ok:
        details = "\n".join(o.summary() + ("\n" + o.error if o.error else "") for o in result.outcomes)
        raise RuntimeError(f"pool case {case.check} failed:\n{details}")
    if result.pool_rebuilt:
        raise RuntimeError(f"pool was rebuilt during {case.check}; timings would be meaningless")
    for o in result.outcomes:
        if o.value.findings:
            raise RuntimeError(f"pool case {case.check} reported findings on rank {o.rank}: "
                               f"{_findings_text(o.value.findings)}")
    return result


# -- spawn-per-case mode -----------------------------------------------------------------

def _spawn_rank(rank: int, world_size: int, store_path: str, out_dir: str, case: Case) -> None:
    """Entry point of one freshly spawned rank (module level so spawn can pickle it)."""
    stamps = {"entered": time.time()}
    record: Dict[str, Any] = {"rank": rank}
    # The pool's ranks write this deprecation warning to their log files; keep it off the table.
    warnings.filterwarnings("ignore", message=r".*NO_SHARD.*deprecated", category=FutureWarning)
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=SPAWN_CASE_TIMEOUT_S))
        stamps["joined"] = time.time()
        import conformance.checks
        from conformance.spec_loading import load_target

        spec = next(s for s in load_target(case.hook.target) if s.name == case.hook.name)
        fn = conformance.checks.get_rank_check(case.check)
        ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"), "gloo")
        stamps["loaded"] = time.time()
        start = time.perf_counter()
        value = fn(ctx, spec, **case.params)
        record["compute_s"] = time.perf_counter() - start
        stamps["computed"] = time.time()
        record["findings"] = _findings_text(value) if value else ""
        dist.destroy_process_group()
        stamps["destroyed"] = time.time()
    finally:
        record["stamps"] = stamps
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(record, f)


class SpawnCaseCrashed(RuntimeError):
    """A spawned rank died or hung before finishing its case (the case is retried)."""


def _spawn_one(case: Case, world_size: int) -> Dict[str, Any]:
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

        launched = time.time()
        t0 = time.perf_counter()
        pc = tmp.start_processes(_spawn_rank, args=(world_size, store_path, tmpdir, case), nprocs=world_size,
                                 join=False, start_method="spawn")
        procs = pc.processes
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
                                               "finishing the case")
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
    for rec in records:
        if rec.get("findings"):
            raise RuntimeError(f"spawn case {case.check} reported findings on rank {rec['rank']}: "
                               f"{rec['findings']}")
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
        "destroy_s": latest("destroyed") - latest("computed"),
        "exit_s": (launched + wall) - latest("destroyed"),
        # Ranks that finished the case, then died on the way out (non-zero exit code).
        "bad_exits": sum(code != 0 for code in exit_codes),
    }


def bench_spawn(names: Sequence[str], world_size: int, m_cases: int) -> Dict[str, Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the pool does for its ranks
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out: Dict[str, Any] = {"cases": {}, "crashes": []}
    for name in names:
        runs: List[Dict[str, Any]] = []
        while len(runs) < m_cases:
            try:
                runs.append(_spawn_one(CASES[name], world_size))
            except SpawnCaseCrashed as exc:
                out["crashes"].append(f"{CASES[name].check}: {exc}")
                if len(out["crashes"]) > MAX_SPAWN_CRASHES:
                    raise RuntimeError("too many spawn-per-case crashes:\n" + "\n".join(out["crashes"])) from exc
        out["cases"][name] = {key: [r[key] for r in runs] for key in runs[0]}
    return out


# -- report ------------------------------------------------------------------------------

def _ms(x: float) -> str:
    return f"{x * 1e3:9.1f}"


def report(args: argparse.Namespace, names: Sequence[str], pool: Dict[str, Any], spawn: Dict[str, Any],
           total_s: float) -> Dict[str, Any]:
    summary: Dict[str, Any] = {
        "world_size": args.world_size,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "pool_startup_s": pool["startup_s"],
        "cases": {},
    }
    print(f"commhook-conformance: per-case cost, rank pool vs spawn-per-case "
          f"(torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"gloo/cpu, world size {args.world_size})")
    print(f"hook: {HOOK_TARGET} [{HOOK_NAME}], strategy NO_SHARD; pool: {WARMUP_CASES} warm-up + "
          f"{args.cases} timed cases per check; spawn-per-case: {args.spawn_cases} cases per check")
    print()
    print(f"pool start-up (paid once per session and world size): {pool['startup_s'] * 1e3:.0f} ms")
    print()
    header = (f"{'case':<28} {'mode':<16} {'n':>3} {'wall med':>9} {'wall p90':>9} {'compute':>9} "
              f"{'overhead':>9} {'overhead':>9}")
    print(header)
    print(f"{'':<28} {'':<16} {'':>3} {'(ms)':>9} {'(ms)':>9} {'med (ms)':>9} {'med (ms)':>9} {'p90 (ms)':>9}")
    print("-" * len(header))
    for name in names:
        case = CASES[name]
        p, s = pool["cases"][name], spawn["cases"][name]
        pw, pc, po = summarize(p["wall_s"]), summarize(p["compute_s"]), summarize(p["overhead_s"])
        sw, sc, so = summarize(s["wall_s"]), summarize(s["compute_s"]), summarize(s["overhead_s"])
        label = LABELS[name]
        for mode, w, c, o in (("pool", pw, pc, po), ("spawn-per-case", sw, sc, so)):
            print(f"{label:<28} {mode:<16} {w['n']:>3} {_ms(w['median'])} {_ms(w['p90'])} "
                  f"{_ms(c['median'])} {_ms(o['median'])} {_ms(o['p90'])}")
            label = ""
        fw, fc = p["first_wall_s"], p["first_compute_s"]
        print(f"{'':<28} {'pool, 1st case':<16} {1:>3} {_ms(fw)} {'':>9} {_ms(fc)} {_ms(fw - fc)} {'':>9}")
        ratio = sw["median"] / pw["median"]
        summary["cases"][name] = {
            "check": case.check,
            "case_id": case.case_id,
            "params": case.params,
            "pool": {"wall_s": pw, "compute_s": pc, "overhead_s": po,
                     "pool_run_wall_s": summarize(p["pool_wall_s"]),
                     "first_case_wall_s": fw, "first_case_compute_s": fc},
            "spawn": {"wall_s": sw, "compute_s": sc, "overhead_s": so,
                      "start_import_s": summarize(s["start_import_s"]),
                      "rendezvous_s": summarize(s["rendezvous_s"]),
                      "destroy_s": summarize(s["destroy_s"]),
                      "exit_s": summarize(s["exit_s"])},
            "ratio_wall_spawn_over_pool": ratio,
        }
    print()
    for name in names:
        c = summary["cases"][name]
        pl, sp = c["pool"], c["spawn"]
        print(f"{c['check']}: pool overhead per case median {pl['overhead_s']['median'] * 1e3:.2f} ms, "
              f"p90 {pl['overhead_s']['p90'] * 1e3:.2f} ms; median wall per case "
              f"{pl['wall_s']['median'] * 1e3:.1f} ms (pool) vs {sp['wall_s']['median'] * 1e3:.0f} ms "
              f"(spawn-per-case) = {c['ratio_wall_spawn_over_pool']:.0f}x")
        print(f"    spawn-per-case, medians: start + import {sp['start_import_s']['median'] * 1e3:.0f} ms, "
              f"rendezvous {sp['rendezvous_s']['median'] * 1e3:.0f} ms, check (cold) "
              f"{sp['compute_s']['median'] * 1e3:.0f} ms, destroy group {sp['destroy_s']['median'] * 1e3:.0f} ms, "
              f"exit + join {sp['exit_s']['median'] * 1e3:.0f} ms")
    bad_exits = sum(sum(spawn["cases"][n]["bad_exits"]) for n in names)
    if spawn["crashes"] or bad_exits:
        print(f"spawn-per-case: {len(spawn['crashes'])} case(s) crashed before finishing and were re-run; "
              f"{bad_exits} rank(s) finished their case, then exited non-zero")
        for text in spawn["crashes"]:
            print(f"    {text}")
    summary["spawn_crashes"] = spawn["crashes"]
    summary["spawn_bad_exits"] = bad_exits
    print()
    print("wall: controller time per case (pool: around pool.run(case); spawn: start_processes until joined).")
    print("compute: slowest rank's time inside the check function; overhead = wall - compute.")
    print("A fresh process runs the check cold (first FSDP import and first-call set-up happen inside it),")
    print("so spawn-per-case compute is larger than the pool's; 'pool, 1st case' is that cold case on the pool.")
    print(f"total benchmark time: {total_s:.1f} s (pool started {pool['pool_starts']} time(s))")
    summary["total_s"] = total_s
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks per case (default 2)")
    parser.add_argument("--cases", type=int, default=40, help="timed pool cases per check (default 40)")
    parser.add_argument("--spawn-cases", type=int, default=5, help="spawn-per-case cases per check (default 5)")
    parser.add_argument("--check", choices=("averaging", "parity", "both"), default="both",
                        help="fsdp.averaging (NO_SHARD, analytic_linear), fsdp.parity (NO_SHARD, "
                             "net_wrapped), or both (default)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.cases < 1 or args.spawn_cases < 1:
        parser.error("--world-size, --cases and --spawn-cases must be at least 1")
    names = list(CASES) if args.check == "both" else [args.check]

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    pool = bench_pool(names, args.world_size, args.cases)
    spawn = bench_spawn(names, args.world_size, args.spawn_cases)
    summary = report(args, names, pool, spawn, time.perf_counter() - t0)
    if load_before is not None:
        load_after = os.getloadavg()[0]
        summary["loadavg_1min"] = [load_before, load_after]
        print(f"1-min load average: {load_before:.2f} at start, {load_after:.2f} at end "
              "(other work on the machine inflates both modes)")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
