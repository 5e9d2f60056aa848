"""The rank side of ``scripts/reach_zoo_evidence.py``: what each rank process trains, natively and with each hook
of ``tests/zoo/reach_hooks/``, and how it compares the two bit for bit.

The models (the small MLP, the large wide layer), their builds under each API (DDP, FSDP1 FULL_SHARD and NO_SHARD,
``fully_shard`` with a custom reduce-scatter, a replica hook on an HSDP mesh), torchrun's environment for a layout,
the training loop that records the native gradients or stops at the first step a hook's differ, the buffer sizes a
hook gets from the large model, and the jobs of one spawn (:func:`worker`, which rank 0 ends by writing the results
as JSON). The script's docstring says what the runs are and why.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tests.zoo import reach_hooks as zoo
from tests.zoo.reach_hooks import common as zoo_common
from tests.zoo.reach_hooks import fsdp2 as zoo_fsdp2
from tests.zoo.reach_hooks import replica as zoo_replica

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
        return zoo_common._ddp_mean(state, bucket.buffer())

    def fsdp(self, state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        self.numels.append(grad.numel())
        zoo_common._fsdp_native(state, grad, output)

    def replica(self, state: Any, tensor: torch.Tensor) -> None:
        self.numels.append(tensor.numel())
        zoo_replica._replica_avg(state, tensor)

    def comm(self) -> Any:
        seen = self

        class Comm(zoo_fsdp2._Comm):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                seen.numels.append(input_tensor.numel())
                return zoo_common._reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)

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
