#!/usr/bin/env python3
"""The verdicts of ``tests/zoo/reach_hooks.py``, established outside the suite: native vs hooked, bit for bit.

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

Usage: ``python3 scripts/reach_zoo_evidence.py [--long-steps 256] [--eight] [--apis ddp,fsdp,...]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.zoo import reach_hooks as zoo  # noqa: E402

SHORT_STEPS = 4
LARGE_STEPS = 2
BATCH = 4
SMALL = (10, 33, 5, True)  # in, hidden, out, bias
LARGE = {"ddp": (13, 504125, 1, False), "fsdp": (13, 322643, 1, False), "fsdp_no_shard": (13, 322643, 1, False),
         "fsdp2": (13, 322643, 1, False), "fsdp2_replica": (13, 322643, 1, False)}
#: What the runs train under: the zoo's apis, FSDP1 twice (FULL_SHARD as "fsdp", and NO_SHARD).
APIS = ("ddp", "fsdp", "fsdp_no_shard", "fsdp2", "fsdp2_replica")
ZOO_API = {"fsdp_no_shard": "fsdp"}


class Net(nn.Module):
    def __init__(self, inp: int, hidden: int, out: int, bias: bool) -> None:
        super().__init__()
        self.wide = nn.Linear(inp, hidden, bias=bias)
        self.head = nn.Linear(hidden, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(x)))


def batch(shape: Tuple[int, int, int, bool], rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(BATCH, shape[0], generator=g)
    target = torch.rand(BATCH, shape[2], generator=g) * 2 - 1
    return x, target


TORCHRUN_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


def set_layout(layout: str, rank: int, world_size: int) -> None:
    """torchrun's environment for ``layout``: "none" (unset, as the suite's pools before issue 28), "1" (one node)
    or "NxM" (N nodes of M ranks)."""
    if layout == "none":
        for var in TORCHRUN_VARS:
            os.environ.pop(var, None)
        return
    nodes, per_node = (1, world_size) if layout == "1" else map(int, layout.split("x"))
    assert nodes * per_node == world_size, (layout, world_size)
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node),
                      GROUP_RANK=str(rank // per_node), GROUP_WORLD_SIZE=str(nodes), ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world_size))


# -- models -----------------------------------------------------------------------------------------------------


class Meshes:
    def __init__(self, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.flat = init_device_mesh("cpu", (world_size,))
        self.hsdp = None
        if world_size % 2 == 0 and world_size >= 4:
            self.hsdp = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))


def build(api: str, shape: Any, spec: Any, meshes: Meshes) -> Tuple[nn.Module, List[Any]]:
    """The model under ``api``, with ``spec``'s hook (``None``: native); returns it and a function giving its grads."""
    torch.manual_seed(0)
    net = Net(*shape)
    if api == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
        if spec is not None:
            model.register_comm_hook(spec.state(dist.group.WORLD), spec.hook)
        return model, lambda: [p.grad for p in model.module.parameters()]
    if api in ("fsdp", "fsdp_no_shard"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        strategy = ShardingStrategy.NO_SHARD if api == "fsdp_no_shard" else ShardingStrategy.FULL_SHARD
        kw = dict(sharding_strategy=strategy, device_id=torch.device("cpu"))
        net.wide = FSDP(net.wide, **kw)
        net.head = FSDP(net.head, **kw)
        model = FSDP(net, **kw)
        if spec is not None:
            model.register_comm_hook(spec.state(dist.group.WORLD), spec.hook)
        return model, lambda: [p.grad for p in model.parameters()]
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if api == "fsdp2":
        mesh = meshes.flat
    else:
        mesh = meshes.hsdp if spec is None else meshes.hsdp["shard"]
    for module in (net.wide, net.head, net):
        fully_shard(module, mesh=mesh)
    if spec is not None:
        fsdp_modules = [m for m in net.modules() if isinstance(m, FSDPModule)]
        if api == "fsdp2":
            is_comm = not isinstance(spec.hook, type) and callable(getattr(spec.hook, "allocate", None))
            comm = spec.hook if is_comm else spec.hook()  # a comm object, or its factory (a class)
            for m in fsdp_modules:
                m.set_custom_reduce_scatter(comm)
        else:
            state = spec.state(meshes.hsdp.get_group("replicate"))
            for m in fsdp_modules:
                m.set_all_reduce_hook(functools.partial(spec.hook, state))
    return net, lambda: [p.grad.to_local() for p in net.parameters()]


def bitwise_equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan() & b.isnan()
    return bool((((a == b) & (torch.signbit(a) == torch.signbit(b))) | nan).all())


def max_abs_diff(grads: List[Any], native: List[Any]) -> float:
    worst = 0.0
    for a, b in zip(grads, native):
        if a is None or b is None or a.shape != b.shape or a.numel() == 0:
            continue
        d = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
        worst = max(worst, float(d.max()))
    return worst


def train(api: str, shape: Any, spec: Any, meshes: Meshes, steps: int, rank: int,
          native: Optional[List[List[torch.Tensor]]]) -> Dict[str, Any]:
    """Native (``native is None``: records and returns the grads of every step) or hooked (compares every step)."""
    model, grads_of = build(api, shape, spec, meshes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record: List[List[torch.Tensor]] = []
    for step in range(steps):
        x, target = batch(shape, rank, step)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        grads = grads_of()
        if native is None:
            record.append([g.detach().clone() for g in grads])
        else:
            differs = not all(bitwise_equal(a, b) for a, b in zip(grads, native[step]))
            flag = torch.tensor([1.0 if differs else 0.0, max_abs_diff(grads, native[step]) if differs else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag[0] > 0:
                return {"first": step, "max_abs": float(flag[1]), "steps": step + 1}
        opt.step()
    return {"record": record} if native is None else {"first": None, "steps": steps}


# -- the buffers the hooks see ----------------------------------------------------------------------------------


class _Seen:
    """Hooks that record the sizes of the buffers they are given and reduce natively (the sizes the large model
    reaches, printed with the table)."""

    def __init__(self) -> None:
        self.numels: List[int] = []

    def ddp(self, state, bucket):  # no annotations: this module's are strings, which DDP refuses
        self.numels.append(bucket.buffer().numel())
        return zoo._ddp_mean(state, bucket.buffer())

    def fsdp(self, state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        self.numels.append(grad.numel())
        zoo._fsdp_native(state, grad, output)

    def replica(self, state: Any, tensor: torch.Tensor) -> None:
        self.numels.append(tensor.numel())
        zoo._replica_avg(state, tensor)

    def comm(self) -> Any:
        seen = self

        class Comm(zoo._Comm):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                seen.numels.append(input_tensor.numel())
                return zoo._reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)

        return Comm()


def buffers_seen(api: str, meshes: "Meshes", rank: int) -> List[int]:
    """The buffer sizes a hook of ``api`` gets from the large model, over 2 steps (DDP rebuilds its buckets after
    the first), distinct, largest first."""
    from types import SimpleNamespace

    seen = _Seen()
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    spec = {"ddp": SimpleNamespace(hook=seen.ddp, state=lambda pg: pg),
            "fsdp": SimpleNamespace(hook=seen.fsdp, state=DefaultState),
            "fsdp_no_shard": SimpleNamespace(hook=seen.fsdp, state=DefaultState),
            "fsdp2": SimpleNamespace(hook=seen.comm, state=None),
            "fsdp2_replica": SimpleNamespace(hook=seen.replica, state=lambda group: group)}[api]
    train(api, LARGE[api], spec, meshes, LARGE_STEPS, rank, None)
    return sorted(set(seen.numels), reverse=True)


# -- the jobs ---------------------------------------------------------------------------------------------------


def specs_of(api: str, axis: Optional[str] = None) -> List[Any]:
    api = ZOO_API.get(api, api)
    return [s for s in zoo.ALL if s.api == api and (axis is None or zoo.REACH[s.name]["axis"] == axis)]


def jobs_for(world_size: int, apis: List[str], long_steps: int, eight: bool) -> List[Tuple[str, str, str, int, str]]:
    """``(label, api, model, steps, layout)`` for one spawn of ``world_size`` ranks."""
    jobs = []
    for api in apis:
        replica = api == "fsdp2_replica"
        if not replica and world_size == 2 or replica and world_size == 4:
            jobs.append(("small-noenv", api, "small", SHORT_STEPS, "none"))
        if not replica and world_size in (2, 3) or replica and world_size == 4:
            jobs.append(("small", api, "small", SHORT_STEPS, "1"))
        if world_size == (4 if replica else 2):
            jobs.append(("large", api, "large", LARGE_STEPS, "1"))
            jobs.append(("long", api, "small", long_steps, "1"))
        if world_size == 3 and not replica:
            jobs.append(("large", api, "large", LARGE_STEPS, "1"))
        if world_size == 2 and not replica:
            jobs.append(("2x1", api, "small", SHORT_STEPS, "2x1"))
        if world_size == 4:
            if not replica:
                jobs.append(("small", api, "small", SHORT_STEPS, "1"))
            jobs.append(("2x2", api, "small", SHORT_STEPS, "2x2"))
        if world_size == 8 and eight:
            jobs.append(("2x4", api, "small", SHORT_STEPS, "2x4"))
    return jobs


def specs_for(label: str, api: str, world_size: int) -> List[Any]:
    if label == "small-noenv":
        return specs_of(api)
    if label == "small":
        return specs_of(api, "topology") if world_size == 4 and api != "fsdp2_replica" else specs_of(api)
    return specs_of(api, {"large": "size", "long": "horizon"}.get(label, "topology"))


def worker(rank: int, world_size: int, port: int, apis: List[str], long_steps: int, eight: bool, out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's deprecation notice, once per model
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    set_layout("1", rank, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    meshes = Meshes(world_size)
    results: Dict[str, Any] = {}
    for label, api, model, steps, layout in jobs_for(world_size, apis, long_steps, eight):
        set_layout(layout, rank, world_size)
        if label == "large":
            results[f"buffers|{api}|ws{world_size}"] = buffers_seen(api, meshes, rank)
        shape = SMALL if model == "small" else LARGE[api]
        started = time.perf_counter()
        native = train(api, shape, None, meshes, steps, rank, None)["record"]
        native_s = time.perf_counter() - started
        for spec in specs_for(label, api, world_size):
            started = time.perf_counter()
            try:
                result = train(api, shape, spec, meshes, steps, rank, native)
            except Exception as exc:  # a hook that raises: reported, not a crash of the whole run
                result = {"error": f"{type(exc).__name__}: {exc}"[:200], "steps": None, "first": None}
            result.update(seconds=round(time.perf_counter() - started, 2), native_seconds=round(native_s, 2))
            results[f"{spec.name}|{api}|{label}|ws{world_size}"] = result
        dist.barrier()
    set_layout("1", rank, world_size)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


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
