"""The training loop of a standalone reproducer: the native and the hooked copy side by side, compared bit for bit.

A reproducer (:func:`conformance.reproducers.writer.reproducer_source`) holds, of this module and its
pieces, what its case runs (:mod:`conformance.reproducers.sources`): this loop (:func:`run`,
:func:`main`, :func:`train_step`), the comparison (:mod:`~conformance.shared.standalone_compare`),
the launcher (:mod:`~conformance.shared.standalone_launch`) and the one way of making inputs its case
uses (:mod:`~conformance.shared.standalone_inputs`), below the case (``CASE``), the model class
(``MODEL``), the names the writer binds per case (``STEP_INPUTS``, ``LOSS``) and the API's part
(``conformance/apis/<api>/standalone.py``: ``subgroup``, ``build``, ``no_sync``, ``tensors``,
``GRADIENT``, ``PARAMETER``) and ``REFERENCE``, the name of what the hooked copy is compared with. It
imports only the standard library and torch, so the file runs where the suite is not installed.

It mirrors the suite's lock-step loop (``conformance/ranks/checks/lockstep.py``,
modelled on ``_get_grads`` of PyTorch's ``test_ddp_hooks.py``): per step, zero
the gradients, forward and backward both copies on this rank's inputs (all
micro-batches but the last under the API's ``no_sync``), compare the gradients
(:func:`differs`, through the API's ``tensors``), then, where the check steps SGD,
``SGD(foreach=False)`` steps on both and compare the parameters.
The first difference is printed per rank (parameter FQN, index, both values
and their bits); the ranks agree, with an all-reduce, to stop together.

``python FILE.py`` starts the case's ranks itself (``launch``:
``torch.multiprocessing.start_processes``, forking CPU ranks) on the backend the suite placed the
case on (``CASE["backend"]``: gloo on CPU, or one process per GPU with NCCL); under ``torchrun`` the file runs as one of its
workers. Either way the same verdict line is
printed, and ``python FILE.py`` exits with it: 1 the difference reproduces, 0 it
does not, 2 it could not run (a process group that cannot start, a launch that
does not fit the case's world size; the file's head exits 2 itself where the
hook's module cannot be imported, naming the error). torchrun's own exit status
is 1 for any failed worker, so under torchrun read the verdict line.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.shared.standalone_compare import first_difference
from conformance.shared.standalone_launch import COULD_NOT_RUN, NOT_REPRODUCED, REPRODUCED, launch, layout_env, pin_nccl

#: The modules a reproducer's code is read from, lowest first (:mod:`conformance.reproducers.sources`).
PIECES = ("conformance.shared.standalone_compare", "conformance.shared.standalone_inputs",
          "conformance.shared.standalone_launch", __name__)


#: This rank's place in the run: ``rank``, ``world_size``, ``group`` (the process group the models train in),
#: ``device``; the API's part may give a subgroup's (``subgroup()``).
Ranks = collections.namedtuple("Ranks", "rank world_size group device")
#: ``--without-hook``: the hooked copy is built native too (the file must then find no difference).
NATIVE_ONLY = "--without-hook" in sys.argv[1:]


def data_parallel_groups(world_size: int) -> List[List[int]]:
    """The data-parallel subgroups of the subgroup cases: ``[[0, N/2], [1, N/2 + 1], ...]``."""
    half = world_size // 2
    return [[i, i + half] for i in range(half)]


def on_data_parallel_subgroup(ranks: Ranks) -> Ranks:
    """``ranks`` with this rank's data-parallel subgroup (``dist.new_subgroups_by_enumeration``, collective) as
    its group and world size; the rank stays the global one (the inputs differ per group)."""
    mine, _ = dist.new_subgroups_by_enumeration(data_parallel_groups(ranks.world_size))
    return Ranks(ranks.rank, mine.size(), mine, ranks.device)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inputs: List[Tuple[torch.Tensor, ...]]) -> None:
    """Zero the gradients; forward/backward each micro-batch (``LOSS``), all but the last under ``no_sync(model)``."""
    optim.zero_grad(set_to_none=True)
    if CASE["micro_steps"] > 1:
        for micro in inputs[:-1]:
            with no_sync(model):
                LOSS(micro, model(*micro)).backward()
    LOSS(inputs[-1], model(*inputs[-1])).backward()


def hook_raised(rank: int, when: str, exc: Exception) -> int:
    """A rank whose hooked copy raised where native did not: the traceback, and the verdict (the other ranks,
    left waiting in a collective, are stopped by the launcher, or by torchrun). Under ``NATIVE_ONLY`` no hook
    ran: the exception is raised again (could not run)."""
    if NATIVE_ONLY:
        raise
    traceback.print_exc()
    print(f"the difference reproduces: hook {CASE['hook']} raised on rank {rank} {when}, where {REFERENCE} "
          f"did not: {type(exc).__name__}: {exc}", flush=True)
    return REPRODUCED


def clip(model: nn.Module) -> torch.Tensor:
    """The API's ``clip_grad_norm_`` of ``model`` with the case's ``max_norm`` and ``norm_type`` (``CASE["clip"]``),
    as the suite's clip check calls it after every backward: FSDP1's own method where the model has one
    (``FullyShardedDataParallel.clip_grad_norm_``, which all-reduces the shards' norms), else
    ``torch.nn.utils.clip_grad_norm_`` over its parameters (DDP; FSDP2, whose DTensor norm is taken whole).
    Returns the total norm, flattened."""
    max_norm, norm_type = CASE["clip"]["max_norm"], float(CASE["clip"]["norm_type"])
    if hasattr(model, "clip_grad_norm_"):
        norm = model.clip_grad_norm_(max_norm, norm_type)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach().reshape(-1)


def differs(what: str, got: Dict[str, Any], want: Dict[str, Any], ranks: Ranks, step: int) -> bool:
    """Whether ``what`` of the hooked copy (``got``: ``{fqn: tensor}``, the API's ``tensors(hooked, what)``) differs
    bit for bit from native's (``want``) on any rank: each rank prints its first difference (in native's FQN
    order), rank 0 the verdict; every rank gets the same answer (an all-reduce: the ranks stop together)."""
    line = None
    for fqn, expected in want.items():
        why = first_difference(got.get(fqn), expected)
        if why is not None:
            line = f"[rank {ranks.rank}, step {step}, parameter {fqn!r}] {what} differs from {REFERENCE}: {why}"
            print(line + "\n", end="", flush=True)  # one write a line, buffered or not: the ranks share the terminal
            break
    anywhere = torch.tensor([int(line is not None)], device=ranks.device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if not anywhere.item():
        return False
    if ranks.rank == 0:
        who = "native" if NATIVE_ONLY else f"hook {CASE['hook']}"
        print(f"the difference reproduces: {who} differs from {REFERENCE} at step {step}", flush=True)
    dist.barrier()
    return True


def main() -> int:
    """This rank's run of the case: build native and hooked copies (both native under ``NATIVE_ONLY``), train them
    in lock step, compare the gradients (and, where the check steps SGD, the parameters) bit for bit, and return
    the verdict (``REPRODUCED``, ``NOT_REPRODUCED``, ``COULD_NOT_RUN``)."""
    if CASE["backend"] == "nccl":  # one GPU a rank, and NCCL's choices pinned, as the suite placed the case
        pin_nccl(os.environ)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if CASE["nodes"] > 1:  # the layout the case simulated: torchrun's variables as on that many nodes
        os.environ.update(layout_env(int(os.environ["RANK"]), CASE["world_size"], CASE["nodes"]))
    dist.init_process_group(CASE["backend"])
    if dist.get_world_size() != CASE["world_size"]:
        print(f"could not run: the case runs {CASE['world_size']} ranks, not {dist.get_world_size()}", flush=True)
        return COULD_NOT_RUN
    ranks = subgroup(Ranks(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device))
    native = build(ranks, hooked=False)
    try:
        hooked = build(ranks, hooked=not NATIVE_ONLY)
    except Exception as exc:  # noqa: BLE001 - the hook's state or its registration raised
        return hook_raised(ranks.rank, "building the hooked copy", exc)
    optims = [torch.optim.SGD(m.parameters(), lr=CASE["lr"], momentum=CASE["momentum"], foreach=False)
              for m in (native, hooked)]
    for step in range(CASE["steps"]):
        inputs = STEP_INPUTS(ranks, step)
        train_step(native, optims[0], inputs)
        try:
            train_step(hooked, optims[1], inputs)
        except Exception as exc:  # noqa: BLE001 - the hook raised where native did not
            return hook_raised(ranks.rank, f"at step {step}", exc)
        if CASE.get("clip") is not None:  # the clip check: clip_grad_norm_ after every backward, its norm first
            norm = f"the total norm of clip_grad_norm_(norm_type={CASE['clip']['norm_type']})"
            if differs(norm, {"total norm": clip(hooked)}, {"total norm": clip(native)}, ranks, step):
                return REPRODUCED
        if differs(GRADIENT, tensors(hooked, GRADIENT), tensors(native, GRADIENT), ranks, step):
            return REPRODUCED
        if CASE["optimizer_step"]:
            for optim in optims:
                optim.step()
            if differs(PARAMETER, tensors(hooked, PARAMETER), tensors(native, PARAMETER), ranks, step):
                return REPRODUCED
    if ranks.rank == 0:
        print(f"no difference in {CASE['steps']} step(s)", flush=True)
    dist.barrier()
    return NOT_REPRODUCED


def run(rank: Optional[int] = None) -> None:
    """The file's entry. ``python FILE.py`` (no ``RANK`` set) starts the case's ranks (``launch``), each of which
    runs ``run(rank)``, and exits with their verdict. A rank (one of those, or torchrun's worker: ``RANK`` and
    ``LOCAL_RANK`` set) runs :func:`main`, then leaves at once with its status (``os._exit``: the interpreter's
    teardown of FSDP2's and gloo's threads can abort a process that already gave its answer). Anything that
    raises outside the hook (a process group that cannot start, the native copy) is :data:`COULD_NOT_RUN`,
    never 1, the status of a reproduced difference."""
    if rank is None and "RANK" not in os.environ:
        sys.exit(launch())
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        code = main()
    except BaseException as exc:  # noqa: BLE001 - reported, and the status says so
        traceback.print_exc()
        print(f"could not run: {type(exc).__name__}: {exc}", flush=True)
        code = COULD_NOT_RUN
    os._exit(code)  # every line was printed with flush=True, and stderr writes each line
