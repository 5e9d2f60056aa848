"""The suite's settings, resolved once: command line, then environment, then the machine.

Each option is declared once (:data:`conformance.controller.options.OPTIONS`) and read from
one place (:func:`resolve`); what the machine can hold is :mod:`conformance.controller.capacity`.
An invalid value raises :class:`SettingsError`, whose message says where the value
came from (``--world-size`` or ``CONFORM_WORLD_SIZE``); one value is read and checked in
:mod:`conformance.controller.option_values`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from conformance import fixtures
from conformance.shared.remote_link import LinkError, parse_address, read_authkey

from conformance.controller.capacity import available_memory, check_cpu_capacity, cpu_count
from conformance.controller.options import (DEFAULT_CASE_TIMEOUT_S, DEFAULT_HYPOTHESIS_EXAMPLES,
                                            DEFAULT_LISTEN_TIMEOUT_S, DEFAULT_RANK_LOG_LIMIT_MIB,
                                            DEFAULT_RANK_MEMORY_GROWTH_MIB, DEPTHS, HYPOTHESIS_SEED_DEST,
                                            NIGHTLY_HYPOTHESIS_EXAMPLES, OPTIONS, SettingsError)
from conformance.controller.option_values import (flag, given_value, integer, listen_timeout, mib_in_bytes,
                                                 positive_ratio, results_paths)

__all__ = ["Settings", "resolve"]

#: World sizes the default run adds as gloo pools on the CPU when the machine's defaults
#: give world size 1 (one GPU): averaging over one rank proves nothing.
CROSS_RANK_WORLD_SIZE = 2


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved settings of one run.

    Attributes:
        hooks: ``module:ATTR`` targets given with ``--hook``.
        builtins: whether PyTorch's built-in hooks are under test.
        entry_points: whether entry-point specs are loaded.
        world_size: ranks in the main pool.
        extra_world_size: a second pool's world size, or ``None``.
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"``.
        case_timeout_s: seconds a case may go without progress before it counts as hung (at most ten of them in all
            for a case that keeps making progress: :func:`conformance.controller.pools.gather_outcomes`).
        hypothesis_examples: generated examples per hard-input case (before shrinking).
        hypothesis_seed: hypothesis's own ``--hypothesis-seed`` (its pytest plugin's
            option), mixed with each case id; ``""`` when not given.
        known_failures: paths of known-failures files, the packaged one first.
        gpu_count: ``torch.cuda.device_count()`` (0 without CUDA).
        strict_known_failures: a known failure that passes, or an entry that could
            apply to this run and matches no test, fails the run (for nightly gates).
        rank_log_limit_bytes: bytes of each rank's output kept per case (``--rank-log-limit``).
        rank_memory_growth_bytes: bytes a rank's RSS may grow over one hook's cases before the case
            that crossed it fails and the pool is restarted (``--rank-memory-growth``); 0 for no check.
        cpu_pools: world sizes that run as gloo pools on the CPU although
            ``device`` is ``"cuda"``: added when the defaults gave world size 1
            (one GPU), where averaging proves nothing; larger pools that cases
            need run there too (:meth:`on_cpu_pool`). Empty otherwise.
        json_path, markdown_path: absolute paths of the results files to write, or ``None``.
        reproducers_dir: absolute path of the directory that gets a standalone reproducer per failed case
            (``--write-reproducers``, :mod:`conformance.reproducers`), or ``None``.
        baseline_path: absolute path of an earlier run's JSON results, or ``None``.
        fail_on: ``"failures"`` (any failure fails the run), ``"regressions"`` (only new failures, and newly
            never-taken branches of a hook's code, against the baseline do) or ``"uncovered"`` (failures, and any
            never-taken branch of a hook's own code).
        listen: ``(host, port)`` where torchrun's ranks connect (``--listen``;
            :mod:`conformance.controller.remote`), or ``None`` for the local pools.
        listen_timeout_s: seconds to wait for them, at the start and after a restart.
        depth: ``"default"`` or ``"nightly"`` (``--depth``): what the case plans add at nightly depth
            (:attr:`nightly`; README "Depth").
        with_compiled_ddp: DDP's compiled-autograd cases are planned (``--with-compiled-ddp``).
        hook_coverage: which of each hook's own code ran is measured (``--hook-coverage``, on by default;
            :mod:`conformance.ranks.hook_code`).
        max_cost: ``--max-cost``: a hook whose collectives or bytes per training step exceed native's by more than
            this ratio fails the run (:func:`conformance.reports.cost.over_max`); ``None``: cost is reported only.
    """

    hooks: Tuple[str, ...]
    builtins: bool
    entry_points: bool
    world_size: int
    extra_world_size: Optional[int]
    backend: str
    device: str
    case_timeout_s: float
    hypothesis_examples: int
    known_failures: Tuple[str, ...]
    gpu_count: int
    strict_known_failures: bool = False
    cpu_pools: Tuple[int, ...] = ()
    hypothesis_seed: str = ""
    rank_log_limit_bytes: int = int(DEFAULT_RANK_LOG_LIMIT_MIB * 2**20)
    rank_memory_growth_bytes: int = int(DEFAULT_RANK_MEMORY_GROWTH_MIB * 2**20)
    json_path: Optional[str] = None
    markdown_path: Optional[str] = None
    reproducers_dir: Optional[str] = None
    baseline_path: Optional[str] = None
    fail_on: str = "failures"
    listen: Optional[Tuple[str, int]] = None
    listen_timeout_s: float = DEFAULT_LISTEN_TIMEOUT_S
    depth: str = "default"
    with_compiled_ddp: bool = False
    hook_coverage: bool = True
    max_cost: Optional[float] = None

    @property
    def nightly(self) -> bool:
        """Whether the run is at nightly depth: the plans add the cases the default run leaves out for time."""
        return self.depth == "nightly"

    @property
    def world_sizes(self) -> Tuple[int, ...]:
        """Every world size the run checks: the main one first, then the others."""
        sizes = [self.world_size, *self.cpu_pools]
        if self.extra_world_size and self.extra_world_size not in sizes:
            sizes.append(self.extra_world_size)
        return tuple(sizes)

    def role(self, world_size: int) -> str:
        """``"main"`` (the full case plan) or ``"extra"`` (the short plan of the extra world size, at the default
        depth; at nightly depth every world size gets the full plan)."""
        if self.nightly or world_size == self.world_size or (
                world_size in self.cpu_pools and world_size != self.extra_world_size):
            return "main"
        return "extra"

    def on_cpu_pool(self, world_size: int) -> bool:
        """Whether the pool of ``world_size`` ranks runs gloo on the CPU although ``device`` is ``"cuda"``: one
        of :attr:`cpu_pools`, or, on that one-GPU machine, any larger pool a case needs (4 ranks for the
        subgroup and HSDP cases), which a CPU machine would run too."""
        return world_size in self.cpu_pools or (bool(self.cpu_pools) and world_size > self.gpu_count)

    def placement(self, world_size: int) -> Tuple[str, str]:
        """``(backend, device)`` of the pool of ``world_size`` ranks."""
        if self.on_cpu_pool(world_size):
            return "gloo", "cpu"
        return self.backend, self.device

    def world_size_unavailable(self, world_size: int) -> Optional[str]:
        """Why a pool of ``world_size`` cannot run here, or ``None`` if it can."""
        if self.listen is not None:
            return None if world_size == self.world_size else (
                f"world size {world_size}: the ranks are torchrun's (--listen), one group of --world-size "
                f"{self.world_size}; run torchrun with {world_size} ranks and --world-size {world_size} for it")
        if self.placement(world_size)[1] == "cuda" and world_size > self.gpu_count:
            return (f"world size {world_size} needs {world_size} GPUs (one rank per GPU), "
                    f"but this machine has {self.gpu_count}")
        return None

    def rerun_args(self, world_size: Optional[int] = None) -> List[str]:
        """Options that reproduce this run's machine settings, as ``[flag, value, ...]``.

        Values that change what a case does or where it runs are always
        spelled out, so the command does not depend on the caller's environment,
        and file paths (``--known-failures``) are absolute, so it does not depend on
        the directory either. A case of world size ``world_size`` that ran on an
        CPU pool (:meth:`on_cpu_pool`) is re-run on a gloo CPU pool of that size.
        """
        if world_size is not None and self.on_cpu_pool(world_size):
            args = ["--world-size", str(world_size), "--extra-world-size", "0", "--backend", "gloo",
                    "--device", "cpu"]
        else:
            args = ["--world-size", str(self.world_size), "--extra-world-size", str(self.extra_world_size or 0),
                    "--backend", self.backend, "--device", self.device]
        if self.case_timeout_s != DEFAULT_CASE_TIMEOUT_S:
            args += ["--case-timeout", f"{self.case_timeout_s:g}"]
        if self.nightly:
            args += ["--depth", self.depth]
        if self.hypothesis_examples != (NIGHTLY_HYPOTHESIS_EXAMPLES if self.nightly else DEFAULT_HYPOTHESIS_EXAMPLES):
            args += ["--hypothesis-examples", str(self.hypothesis_examples)]
        if self.with_compiled_ddp:
            args += ["--with-compiled-ddp"]
        if self.hypothesis_seed:
            args += ["--hypothesis-seed", str(self.hypothesis_seed)]
        default_kf = os.path.abspath(_default_known_failures())
        for path in self.known_failures:
            if os.path.abspath(path) != default_kf:
                args += ["--known-failures", os.path.abspath(path)]
        return args


def _default_known_failures() -> str:
    return os.path.join(os.path.dirname(fixtures.__file__), "known_failures.toml")


def resolve(getoption: Callable[[str], Any], env: Optional[Dict[str, str]] = None,
            gpu_count: Optional[int] = None, cores: Optional[int] = None,
            memory: Optional[int] = -1) -> Settings:
    """Resolve every option from ``getoption(dest)``, then ``env``, then the machine.

    ``gpu_count``, ``cores`` and ``memory`` (bytes available, ``None`` for
    unknown) describe the machine; by default they are read from it.

    Raises:
        SettingsError: an invalid value, or a combination this machine cannot
            run (CUDA without GPUs, NCCL on CPU, more ranks than GPUs, more CPU
            ranks than the cores and memory hold).
    """
    env = dict(os.environ) if env is None else env
    if gpu_count is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = cpu_count() if cores is None else cores
    memory = available_memory() if memory == -1 else memory
    by_dest = {o.dest: o for o in OPTIONS}

    def pick(dest: str) -> Tuple[Any, str]:
        return given_value(getoption(dest), by_dest[dest], env)

    strict_value, strict_source = pick("conform_strict_known_failures")
    strict = flag(strict_value, strict_source)

    hooks_value, hooks_source = pick("conform_hooks")
    if isinstance(hooks_value, str):
        hooks = tuple(hooks_value.split())
    else:
        hooks = tuple(hooks_value or ())
    with_builtins = bool(getoption("conform_with_builtins"))

    listen_value, listen_source = pick("conform_listen")
    listen = _listen(listen_value, listen_source, env, pick)  # the nodes' GPUs are not counted here
    device, device_source = pick("conform_device")
    device = device or ("cuda" if gpu_count else "cpu")
    if device not in ("cpu", "cuda"):
        raise SettingsError(f"invalid device {device!r} from {device_source}: expected cpu or cuda")
    if device == "cuda" and not gpu_count and listen is None:
        raise SettingsError(f"device cuda from {device_source} but no CUDA GPU is visible "
                            "(torch.cuda.is_available() is False); use --device cpu --backend gloo")

    backend, backend_source = pick("conform_backend")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise SettingsError(f"invalid backend {backend!r} from {backend_source}: expected gloo or nccl")
    if backend == "nccl" and device != "cuda":
        raise SettingsError(f"backend nccl from {backend_source} needs --device cuda; NCCL has no CPU path "
                            "(use --backend gloo on CPU)")

    ws_value, ws_source = pick("conform_world_size")
    if ws_value is None:
        world_size = gpu_count if device == "cuda" else 2
    else:
        world_size = integer(ws_value, ws_source, minimum=1)
        if device == "cuda" and world_size > gpu_count and listen is None:
            raise SettingsError(
                f"--world-size {world_size} (from {ws_source}) is larger than the GPU count: this machine has "
                f"{gpu_count} GPU(s) (torch.cuda.device_count()), and each rank needs its own GPU. Use "
                f"--world-size {gpu_count}, or --device cpu --backend gloo for CPU ranks.")

    extra_value, extra_source = pick("conform_extra_world_size")
    extra = (0 if listen else 3) if extra_value is None else integer(extra_value, extra_source, minimum=0)
    cpu_pools: Tuple[int, ...] = ()
    if device == "cuda" and ws_value is None and world_size == 1:
        # One GPU: averaging over one rank proves nothing, so the cross-rank checks
        # run on gloo CPU pools, and the extra world size joins them there.
        cpu_pools = tuple(sorted({CROSS_RANK_WORLD_SIZE, *([extra] if extra > 1 else [])}))
    cpu_sizes = [(world_size, ws_source or "the default world size")] if device == "cpu" else []
    cpu_sizes += [(ws, "the default one-GPU cross-rank pools") for ws in cpu_pools]
    if extra and extra not in (world_size, *cpu_pools) and device == "cpu":
        cpu_sizes.append((extra, extra_source or "the default extra world size"))
    check_cpu_capacity(cpu_sizes if listen is None else [], cores, memory)

    timeout_value, timeout_source = pick("conform_case_timeout")
    try:
        timeout = DEFAULT_CASE_TIMEOUT_S if timeout_value is None else float(timeout_value)
    except ValueError:
        raise SettingsError(f"invalid case timeout {timeout_value!r} from {timeout_source}: expected seconds") from None
    if not math.isfinite(timeout) or timeout <= 0:
        raise SettingsError(f"invalid case timeout {timeout_value!r} from {timeout_source}: must be a positive, finite number of seconds")

    depth_value, depth_source = pick("conform_depth")
    depth = "default" if depth_value is None else str(depth_value).strip().lower()
    if depth not in DEPTHS:
        raise SettingsError(f"invalid depth {depth_value!r} from {depth_source}: expected one of {', '.join(DEPTHS)} "
                            "(nightly adds the cases the default run leaves out for time)")
    compiled_value, compiled_source = pick("conform_with_compiled_ddp")
    with_compiled_ddp = flag(compiled_value, compiled_source)
    coverage_value, coverage_source = pick("conform_hook_coverage")
    hook_coverage = True if coverage_value is None else flag(coverage_value, coverage_source)

    ex_value, ex_source = pick("conform_hypothesis_examples")
    if ex_value is None:
        examples = NIGHTLY_HYPOTHESIS_EXAMPLES if depth == "nightly" else DEFAULT_HYPOTHESIS_EXAMPLES
    else:
        examples = integer(ex_value, ex_source, minimum=0)
    try:  # hypothesis's pytest plugin defines the option; it may be disabled (-p no:hypothesispytest)
        hypothesis_seed = getoption(HYPOTHESIS_SEED_DEST)
    except (ValueError, KeyError):
        hypothesis_seed = None
    hypothesis_seed = "" if hypothesis_seed is None else str(hypothesis_seed)

    log_value, log_source = pick("conform_rank_log_limit")
    rank_log_limit = mib_in_bytes(log_value, log_source, DEFAULT_RANK_LOG_LIMIT_MIB, minimum=0.01)
    growth_value, growth_source = pick("conform_rank_memory_growth")
    rank_memory_growth = mib_in_bytes(growth_value, growth_source, DEFAULT_RANK_MEMORY_GROWTH_MIB, minimum=0)

    cost_value, cost_source = pick("conform_max_cost")
    max_cost = None if cost_value is None else positive_ratio(cost_value, cost_source)

    kf_value, _ = pick("conform_known_failures")
    if isinstance(kf_value, str):
        extra_files = tuple(kf_value.split(os.pathsep))
    else:
        extra_files = tuple(kf_value or ())
    # The packaged file always applies: it explains PyTorch's own hooks, which a
    # user's file (for their hooks) should not have to repeat.
    default_file = _default_known_failures()
    known = (default_file,) + tuple(f for f in extra_files if os.path.abspath(f) != os.path.abspath(default_file))
    report_paths = results_paths(pick)

    return Settings(
        hooks=hooks,
        builtins=with_builtins or not hooks,
        entry_points=not getoption("conform_no_entry_points") and (with_builtins or not hooks),
        world_size=world_size,
        extra_world_size=extra or None,
        backend=backend,
        device=device,
        case_timeout_s=timeout,
        hypothesis_examples=examples,
        known_failures=known,
        gpu_count=gpu_count,
        strict_known_failures=strict,
        cpu_pools=cpu_pools,
        hypothesis_seed=hypothesis_seed,
        rank_log_limit_bytes=rank_log_limit,
        rank_memory_growth_bytes=rank_memory_growth,
        **report_paths,
        listen=listen,
        listen_timeout_s=listen_timeout(pick) if listen else DEFAULT_LISTEN_TIMEOUT_S,
        depth=depth,
        with_compiled_ddp=with_compiled_ddp,
        hook_coverage=hook_coverage,
        max_cost=max_cost,
    )


def _listen(value: Optional[str], source: str, env: Dict[str, str],
            pick: Callable[[str], Tuple[Any, str]]) -> Optional[Tuple[str, int]]:
    """``--listen HOST:PORT`` as ``(host, port)``, or ``None``; the run's world size and secret must be given too."""
    if value is None:
        return None
    try:
        address = parse_address(value, source)
        read_authkey(env)
    except LinkError as exc:
        raise SettingsError(str(exc)) from None
    if pick("conform_world_size")[0] is None:
        raise SettingsError(f"{source} needs --world-size N, the WORLD_SIZE of the torchrun job (--nnodes times "
                            "--nproc-per-node): the cases are planned before the ranks connect")
    return address
