#!/usr/bin/env python3
"""What three FSDP2 switches change in what a hook sees, established on gloo, outside the suite (issue 30).

Each part trains a small model natively and with a recording hook, on CPU with gloo, and prints one row per
fact; it exits 1 where a fact does not hold on this torch (a switch this torch lacks is skipped, saying so):

* ``set_reshard_after_forward`` (2 ranks, a root and two child units, 2 steps): the all-gather comm's calls
  per step with ``fully_shard(reshard_after_forward=True / False / left out)``, and with the setter after
  construction. Established on torch 2.13: 6 / 3 / 5 calls (left out, the root keeps its parameters gathered
  for the backward); the setter gives what the constructor argument gives (``True`` after ``False``: 6;
  ``False`` after ``True``: 3; ``True`` where left out: 6, the root re-gathers too);
* ``set_reduce_scatter_unused_params(True)`` (2 ranks, a child unit with a parameter its forward never uses):
  the reduce-scatter comm's input for that unit holds the unused parameter's span as zeros (144 elements, 72
  of them zeros, where 72 without the switch); its gradient is zeros, not ``None``; the comm's gradients are
  bitwise those of native FSDP2 with the same switch;
* ``set_requires_all_reduce(False)`` (4 ranks: a replica all-reduce hook, ``set_all_reduce_hook``, on a 1-D
  shard mesh of 2, replicas {0,2} and {1,3}; 3 micro-batches, the setter ``False`` on the first two): FSDP2
  calls the hook on every micro-batch (the setter gates FSDP2's own replica all-reduce, which a 1-D mesh does
  not have), so the result is bitwise native HSDP (2x2) all-reducing every micro-batch, and not native HSDP
  with the same setter (which all-reduces the accumulated sum once: another rounding). Under
  ``set_requires_gradient_sync(False)`` the hook runs on the last micro-batch only, bitwise native HSDP with
  that setter.

Usage: ``python3 scripts/fsdp2_switches_evidence.py``
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class GatherCounter:
    """An all-gather comm (``set_custom_all_gather``) that counts its calls."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ScatterRecorder(GatherCounter):
    """A reduce-scatter comm (``set_custom_reduce_scatter``) that records each input's size and zeros."""

    def __init__(self):
        self.inputs = []

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.inputs.append((input_tensor.numel(), int((input_tensor == 0).sum())))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _sharded(mesh, unused=False, **kwargs):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    if unused:
        model[1].extra = nn.Linear(8, 8)  # registered, never called
    for module in (model[0], model[1], model):
        fully_shard(module, mesh=mesh, **kwargs)
    return model


def _install(model, setter, comm):
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            getattr(module, setter)(comm)


def _same_grads(a, b):
    return all((p.grad is None and q.grad is None) or torch.equal(p.grad.to_local(), q.grad.to_local())
               for p, q in zip(a.parameters(), b.parameters()))


def two_ranks(rank, rows):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if hasattr(FSDPModule, "set_custom_all_gather"):
        for ctor, setter, want in (({"reshard_after_forward": True}, None, 6), ({"reshard_after_forward": False},
                                   None, 3), ({}, None, 5), ({"reshard_after_forward": False}, True, 6),
                                   ({"reshard_after_forward": True}, False, 3), ({}, True, 6)):
            model = _sharded(mesh, **ctor)
            if setter is not None:
                model.set_reshard_after_forward(setter)
            comm = GatherCounter()
            _install(model, "set_custom_all_gather", comm)
            for _ in range(2):
                model(x).sum().backward()
            rows.append((f"fully_shard({ctor or 'reshard_after_forward left out'})"
                         f"{'' if setter is None else f', then set_reshard_after_forward({setter})'}: all-gather "
                         f"calls a step {comm.calls / 2:g}", comm.calls == 2 * want))
    else:
        rows.append((f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather: skipped", True))
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        rows.append((f"torch {torch.__version__} has no set_reduce_scatter_unused_params: skipped", True))
        return
    for flag, want in ((False, [(72, 0), (36, 0), (72, 0)]), (True, [(144, 72), (36, 0), (72, 0)])):
        model, native = _sharded(mesh, unused=True), _sharded(mesh, unused=True)
        comm = ScatterRecorder()
        _install(model, "set_custom_reduce_scatter", comm)
        for m in (model, native):
            m.set_reduce_scatter_unused_params(flag)
            m(x).sum().backward()
        grad = model[1].extra.weight.grad
        zeros = grad is not None and not bool(grad.to_local().any())
        rows.append((f"set_reduce_scatter_unused_params({flag}): comm inputs (elements, zeros) {comm.inputs}; the "
                     f"unused weight's gradient {'zeros' if zeros else grad}; bitwise native with the same switch: "
                     f"{_same_grads(model, native)}",
                     comm.inputs == want and (zeros if flag else grad is None) and _same_grads(model, native)))


def four_ranks(rank, rows):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    if not hasattr(FSDPModule, "set_requires_all_reduce"):
        rows.append((f"torch {torch.__version__} has no set_requires_all_reduce: skipped", True))
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + k)) for k in range(3)]
    for setter, called_on, native_defers in (("set_requires_all_reduce", [0, 1, 2], False),
                                             ("set_requires_gradient_sync", [2], True)):
        model = _sharded(mesh["shard"])
        calls, micro = [], [0]

        def hook(tensor):
            calls.append(micro[0])
            dist.all_reduce(tensor, group=replicas)
            tensor.div_(2)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(hook)
        native, deferring = _sharded(mesh), _sharded(mesh)
        for k, x in enumerate(xs):
            micro[0] = k
            getattr(model, setter)(k == len(xs) - 1)
            getattr(deferring, setter)(k == len(xs) - 1)
            if native_defers:
                getattr(native, setter)(k == len(xs) - 1)
            for m in (model, native, deferring):
                m(x).sum().backward()
        same = _same_grads(model, native)
        rows.append((f"replica hook on a 1-D shard mesh, {setter}(False) on micro-batches 0 and 1: called on "
                     f"micro-batches {sorted(set(calls))}; bitwise native HSDP "
                     f"{'with the same setter' if native_defers else 'all-reducing every micro-batch'}: {same}",
                     sorted(set(calls)) == called_on and same))
        if not native_defers:
            differs = not _same_grads(model, deferring)
            rows.append((f"  native HSDP with {setter}(False) on the same micro-batches (one all-reduce of the sum) "
                         f"bitwise the hooked model: {not differs}", differs))


def main(rank, world_size, part, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    part(rank, rows)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    ok = True
    ctx = mp.get_context("spawn")
    for world_size, part, port in ((2, two_ranks, 29611), (4, four_ranks, 29612)):
        queue = ctx.SimpleQueue()
        mp.spawn(main, args=(world_size, part, port, queue), nprocs=world_size)
        for text, holds in queue.get():
            print(f"{'holds' if holds else 'DIFFERS':8} {text}")
            ok = ok and holds
    sys.exit(0 if ok else 1)
