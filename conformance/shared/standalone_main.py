"""The training loop of a standalone reproducer: the native and the hooked copy side by side, compared bit for bit.

This module is written, as it is, into every reproducer file
(:func:`conformance.reproducers.reproducer_source`), below the case
(``CASE``), the model class (``MODEL``) and the API's part
(``conformance/apis/<api>/standalone.py``: ``subgroup``, ``build``, ``no_sync``,
``GRAD_VIEWS``, ``PARAM_VIEW``, ``reference``). It imports only the standard library and
torch, so the file runs where the suite is not installed.

It mirrors the suite's lock-step loop (``conformance/ranks/checks/lockstep.py``,
modelled on ``_get_grads`` of PyTorch's ``test_ddp_hooks.py``): per step, zero
the gradients, forward and backward both copies on this rank's inputs (all
micro-batches but the last under the API's ``no_sync``), compare each gradient
view, then ``SGD(foreach=False)`` steps on both and compare the parameters.
The first difference is printed per rank (parameter FQN, index, both values
and their bits); the ranks agree, with an all-reduce, to stop together.

``python FILE.py`` starts the case's ranks itself (:func:`launch`: gloo on CPU,
or one process per GPU with NCCL, :func:`select_backend`); under ``torchrun``
the file runs as one of its workers. Either way the same verdict line is
printed, and ``python FILE.py`` exits with it: 1 the difference reproduces, 0 it
does not, 2 it could not run (a process group that cannot start, a launch that
does not fit the case's world size; the file's head exits 2 itself where the
hook's module cannot be imported, naming the error). torchrun's own exit status
is 1 for any failed worker, so under torchrun read the verdict line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn


class Ranks:
    """This rank's place in the run: ``rank``, ``world_size``, ``group`` (the process group the models
    train in), ``device``; the API's part may give a subgroup's (``subgroup()``)."""

    def __init__(self, rank: int, world_size: int, group: Any, device: torch.device):
        self.rank, self.world_size, self.group, self.device = rank, world_size, group, device


#: Prefixes FSDP (and activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")


def fqn_without_wrappers(name: str) -> str:
    """A parameter's FQN in the unwrapped model: FSDP's wrapper prefixes removed (FSDP1 and FSDP2)."""
    return _WRAPPER_PREFIXES.sub("", name)


def fqn_inside_ddp(name: str) -> str:
    """A parameter's FQN in the model DDP wraps: DDP's own leading ``module.`` removed (once)."""
    return name[len("module."):] if name.startswith("module.") else name


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of a DTensor (``to_local()``, FSDP2), else the tensor itself."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def data_parallel_groups(world_size: int) -> List[List[int]]:
    """The data-parallel subgroups of the subgroup cases: ``[[0, N/2], [1, N/2 + 1], ...]``."""
    half = world_size // 2
    return [[i, i + half] for i in range(half)]


def on_data_parallel_subgroup(ranks: Ranks) -> Ranks:
    """``ranks`` with this rank's data-parallel subgroup (``dist.new_subgroups_by_enumeration``, collective) as
    its group and world size; the rank stays the global one (the inputs differ per group)."""
    mine, _ = dist.new_subgroups_by_enumeration(data_parallel_groups(ranks.world_size))
    return Ranks(ranks.rank, mine.size(), mine, ranks.device)


def _bits(value: torch.Tensor) -> str:
    """The stored bits of a one-element floating tensor, in hex, as wide as its dtype."""
    size = value.element_size()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    raw = int(value.reshape(1).view(ints[size])[0])
    return f"0x{raw & ((1 << (8 * size)) - 1):0{2 * size}x}"


def _short(value: torch.Tensor) -> str:
    """The shortest decimal that reads back as ``value``'s bits in its own dtype (``-0.33552012``)."""
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        return repr(number)
    for digits in range(1, 18):
        text = f"{number:.{digits}g}"
        if _bits(torch.tensor(float(text), dtype=value.dtype)) == _bits(value):
            return text
    return repr(number)


def first_difference(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> Optional[str]:
    """Why ``actual`` (hooked) is not bitwise equal to ``expected`` (native), or ``None``; NaN equals NaN,
    ``-0.0`` is not ``+0.0`` (the suite's ``compare_bitwise``)."""
    if actual is None or expected is None:
        if actual is None and expected is None:
            return None
        hooked, native = ("None" if t is None else "set" for t in (actual, expected))
        return f"is {hooked} with the hook but {native} natively"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} with the hook, {e.dtype} natively"
    if a.shape != e.shape:
        return f"shape {tuple(a.shape)} with the hook, {tuple(e.shape)} natively"
    if not a.is_floating_point():
        differ = a != e
    else:
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        differ = (a.view(ints) != e.view(ints)) & ~(torch.isnan(a) & torch.isnan(e))
    if not bool(differ.any()):
        return None
    flat = int(differ.reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    got, want = a.reshape(-1)[flat], e.reshape(-1)[flat]
    if a.is_floating_point():
        text = f"got {_short(got)} ({_bits(got)}), but expected {_short(want)} ({_bits(want)})"
    else:
        text = f"got {got.item()!r}, but expected {want.item()!r}"
    return f"first difference at index {index}: {text}; {int(differ.sum())} of {a.numel()} elements differ"


def compare(what: str, hooked: Dict[str, Any], native: Dict[str, Any], rank: int, step: int) -> Optional[str]:
    """The first FQN (in ``native``'s order) whose tensor differs, as the line this rank prints, or ``None``."""
    for fqn, expected in native.items():
        why = first_difference(hooked.get(fqn), expected)
        if why is not None:
            return f"[rank {rank}, step {step}, parameter {fqn!r}] {what} differs from {reference()}: {why}"
    return None


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (an all-reduce over the default group: every rank stops together)."""
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _float(text: str) -> float:
    return float.fromhex(text) if "0x" in text else float(text)


# -- the long run's objective ---------------------------------------------------------------------------------
# A model trained hundreds of steps on its own ``output.sum()`` loss overflows within ten: its gradients are then
# NaN on both sides, and NaN equals NaN, so nothing more is checked. The long run instead regresses onto random
# targets, with inputs that change every step: the gradients stay of order 0.1 for thousands of steps.


class SeededInputs(tuple):
    """One micro-batch's inputs (a tuple, passed as ``model(*inputs)``) and the seed of its regression target."""

    seed: int

    def __new__(cls, inputs: Tuple[torch.Tensor, ...], seed: int) -> "SeededInputs":
        out = super().__new__(cls, inputs)
        out.seed = seed
        return out


def regression_inputs(model: Any, rank: int, world_size: int, step: int, micro_steps: int,
                      device: torch.device) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step`` of a long run, one tuple per micro-batch: ``model.make_input`` with a seed
    of its own per rank, micro-batch and step (rank-dependent and distinct, as every check's inputs)."""
    out = []
    for k in range(micro_steps):
        index = rank + (k + step * micro_steps) * world_size
        out.append(SeededInputs(model.make_input(index, world_size, device), index))
    return out


def regression_loss(inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """``mean((output - target) ** 2)``, the target uniform in [-1, 1) of ``output``'s shape from a CPU
    generator seeded by the micro-batch (:class:`SeededInputs`)."""
    gen = torch.Generator().manual_seed(1_000_003 + int(inputs.seed))
    target = (torch.rand(output.shape, generator=gen, dtype=torch.float32) * 2 - 1).to(output.device, output.dtype)
    return ((output - target) ** 2).mean()


#: Elements of the ordinary values a large hard input repeats (a prime: its period lines up with no power of two,
#: no shard and no chunk of a hook).
PLACED_PERIOD = 65_521


def placed_tensor(placed: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """A large hard input from its description (the suite's ``hard_examples.placed_examples``; a reproducer's
    ``CASE["inputs"]``): float32 ``shape``, filled with :data:`PLACED_PERIOD` uniform values in [-1, 1) from a CPU
    generator seeded ``seed``, repeated, times ``scale`` (float32); then ``values`` at the flat positions ``at``
    (floats or float hex). Repeating a block costs a copy, where drawing tens of millions of values costs
    tenths of a second a step."""
    numel = 1
    for d in placed["shape"]:
        numel *= int(d)
    gen = torch.Generator().manual_seed(int(placed["seed"]))
    block = (torch.rand(min(numel, PLACED_PERIOD), generator=gen) * 2 - 1) * torch.tensor(float(placed["scale"]),
                                                                                          dtype=torch.float32)
    out = block.repeat(-(-numel // block.numel()))[:numel]  # a fresh tensor's view: written in place below
    if placed["at"]:
        out[torch.tensor(placed["at"], dtype=torch.int64)] = torch.tensor(
            [_float(v) if isinstance(v, str) else float(v) for v in placed["values"]], dtype=torch.float32)
    return out.reshape(tuple(placed["shape"])).to(device)


def step_inputs(ranks: Ranks, step: int) -> List[Tuple[torch.Tensor, ...]]:
    """This rank's inputs of ``step``, one tuple per micro-batch: the case's recorded gradients (hard inputs,
    ``CASE["inputs"][step][rank]``, float32 hex) or ``MODEL.make_input(rank + k * world_size, ...)``."""
    if CASE.get("objective") == "regression":
        return regression_inputs(MODEL, ranks.rank, ranks.world_size, step, CASE["micro_steps"], ranks.device)
    if CASE["inputs"] is not None:
        shapes = MODEL.input_shapes()
        values = CASE["inputs"][step][ranks.rank]
        return [tuple(placed_tensor(vs, ranks.device) if isinstance(vs, dict) else
                      torch.tensor([_float(v) for v in vs], dtype=torch.float32).reshape(shape).to(ranks.device)
                      for vs, shape in zip(values, shapes))]
    return [MODEL.make_input(ranks.rank + k * ranks.world_size, ranks.world_size, ranks.device)
            for k in range(CASE["micro_steps"])]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inputs: List[Tuple[torch.Tensor, ...]]) -> None:
    """Zero the gradients; forward/backward each micro-batch, all but the last under ``no_sync(model)``."""
    optim.zero_grad(set_to_none=True)
    loss = regression_loss if CASE.get("objective") == "regression" else MODEL.loss
    for k, micro in enumerate(inputs):
        if k == len(inputs) - 1:
            loss(micro, model(*micro)).backward()
        else:
            with no_sync(model):
                loss(micro, model(*micro)).backward()


def layout_env(rank: int, world_size: int, nodes: int) -> Dict[str, str]:
    """torchrun's layout variables of ``rank`` on ``nodes`` nodes of ``world_size // nodes`` ranks (the suite's
    ``conformance.ranks.topology.torchrun_env``), for a case that simulated several nodes."""
    local = world_size // nodes
    return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size)}


#: The reproducer's exit statuses, whichever way it was started (``python FILE.py`` or as torchrun's worker).
NOT_REPRODUCED, REPRODUCED, COULD_NOT_RUN = 0, 1, 2
#: Seconds the launcher lets the other ranks finish after one rank ended with a verdict other than "no
#: difference" (a rank whose hook raised leaves the others waiting in a collective), before it stops them.
GRACE_S = 20.0


def select_backend(cuda_available: bool, gpu_count: int, local_world_size: int) -> Tuple[str, str]:
    """``(backend, device type)`` of the ranks on this machine: ``("nccl", "cuda")``, one GPU per process
    (``LOCAL_RANK``), where CUDA is available with a GPU for each of this machine's ``local_world_size`` ranks;
    else ``("gloo", "cpu")``. The suite places its pools the same way (``Settings.placement``: a world size
    larger than the GPUs runs on CPU ranks, gloo)."""
    if cuda_available and gpu_count >= local_world_size:
        return "nccl", "cuda"
    return "gloo", "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: List[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, then SIGKILL any left after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def combine(codes: List[Optional[int]]) -> Tuple[int, List[str]]:
    """The launcher's exit status from its ranks' (``None``: stopped by the launcher after another rank's
    verdict), and the lines to print for ranks that died without one (a signal, an unexpected status):
    1 where any rank saw the difference, 0 where every rank saw none, else 2."""
    if REPRODUCED in codes:
        return REPRODUCED, []
    if all(c == NOT_REPRODUCED for c in codes):
        return NOT_REPRODUCED, []
    lines = []
    for rank, code in enumerate(codes):
        if code is not None and code < 0:
            lines.append(f"could not run: rank {rank} was killed by signal {signal.Signals(-code).name}")
        elif code not in (None, NOT_REPRODUCED, REPRODUCED, COULD_NOT_RUN):
            lines.append(f"could not run: rank {rank} exited with status {code}")
    return COULD_NOT_RUN, lines


def launch(argv: List[str]) -> int:
    """``python FILE.py``: start the case's ranks on this machine, one process each running this file as a
    worker (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` on loopback, as torchrun sets them), and
    return their verdict (:func:`combine`). CPU ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``), as the suite's."""
    world_size = CASE["world_size"]
    backend, device = select_backend(torch.cuda.is_available(), torch.cuda.device_count(), world_size)
    port = _free_port()
    procs: List[subprocess.Popen] = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *argv], env=env))
    deadline = None
    try:
        while any(p.poll() is None for p in procs):
            if deadline is None and any(p.poll() not in (None, NOT_REPRODUCED) for p in procs):
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        print("could not run: interrupted", flush=True)
        return COULD_NOT_RUN
    codes = [p.poll() for p in procs]
    _stop(procs)
    code, lines = combine(codes)
    for line in lines:
        print(line, flush=True)
    return code


def _hook_raised(rank: int, step: Optional[int], exc: BaseException) -> int:
    """A rank whose hooked copy raised (native trained): the traceback, and the verdict; other ranks are left
    waiting in a collective, so this rank leaves without the closing barrier."""
    traceback.print_exc()
    when = "building the hooked copy" if step is None else f"at step {step}"
    print(f"the difference reproduces: hook {CASE['hook']} raised on rank {rank} {when}, where {reference()} "
          f"did not: {type(exc).__name__}: {exc}", flush=True)
    return REPRODUCED


def main(argv: Optional[List[str]] = None) -> int:
    """Run the case: as torchrun's worker where ``RANK`` is set, else start its ranks (:func:`launch`). The exit
    status says whether the difference reproduces (:data:`REPRODUCED`, :data:`NOT_REPRODUCED`,
    :data:`COULD_NOT_RUN`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--without-hook", action="store_true",
                        help="build the hooked copy without the hook (native on both sides): must print no difference")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        return launch(argv)
    backend, device_type = select_backend(torch.cuda.is_available(), torch.cuda.device_count(),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if CASE.get("nodes", 1) > 1:  # the layout the case simulated: torchrun's variables as on that many nodes
        os.environ.update(layout_env(int(os.environ["RANK"]), CASE["world_size"], CASE["nodes"]))
    dist.init_process_group(backend)
    if dist.get_world_size() != CASE["world_size"]:
        if dist.get_rank() == 0:
            print(f"could not run: this case ran at world size {CASE['world_size']}, not {dist.get_world_size()}: "
                  f"python {sys.argv[0]}, or torchrun --nproc-per-node {CASE['world_size']} {sys.argv[0]}",
                  flush=True)
        return COULD_NOT_RUN
    ranks = subgroup(Ranks(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device))
    native = build(ranks, hooked=False)
    try:
        hooked = build(ranks, hooked=not args.without_hook)
    except Exception as exc:  # noqa: BLE001 - the hook's state or its registration raised
        if args.without_hook:
            raise
        return _hook_raised(ranks.rank, None, exc)
    optims = [torch.optim.SGD(m.parameters(), lr=CASE["lr"], momentum=CASE["momentum"], foreach=False)
              for m in (native, hooked)]
    for step in range(CASE["steps"]):
        inputs = step_inputs(ranks, step)
        train_step(native, optims[0], inputs)
        try:
            train_step(hooked, optims[1], inputs)
        except Exception as exc:  # noqa: BLE001 - the hook raised where native did not
            if args.without_hook:
                raise
            return _hook_raised(ranks.rank, step, exc)
        views = GRAD_VIEWS[:CASE["grad_views"]] + ([PARAM_VIEW] if CASE["optimizer_step"] else [])
        for k, (what, view) in enumerate(views):
            if CASE["optimizer_step"] and k == len(views) - 1:
                for optim in optims:
                    optim.step()
            line = compare(what, view(hooked), view(native), ranks.rank, step)
            if line is not None:
                sys.stdout.write(line + "\n")  # one write a line: the ranks share the terminal
                sys.stdout.flush()
            if any_rank(line is not None, device):
                if ranks.rank == 0:
                    who = ("native differs from native: not deterministic here" if args.without_hook else
                           f"hook {CASE['hook']} differs from {reference()} at step {step}")
                    print(f"the difference reproduces: {who}", flush=True)
                dist.barrier()
                return REPRODUCED
    if ranks.rank == 0:
        print(f"no difference in {CASE['steps']} step(s): "
              + ("native equals native" if args.without_hook else "the case does not reproduce here"), flush=True)
    dist.barrier()
    return NOT_REPRODUCED


def run() -> None:
    """:func:`main`, then leave at once with its exit status (``os._exit``: the interpreter's teardown of FSDP2's
    and gloo's threads can abort a process that already gave its answer). Anything that raises outside the
    hook (a process group that cannot start, the native copy) is :data:`COULD_NOT_RUN`, never exit 1, the
    status of a reproduced difference."""
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help (0), a bad option (2)
        code = exc.code if isinstance(exc.code, int) else COULD_NOT_RUN
    except BaseException as exc:  # noqa: BLE001 - reported, and the status says so
        traceback.print_exc()
        print(f"could not run: {type(exc).__name__}: {exc}", flush=True)
        code = COULD_NOT_RUN
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
