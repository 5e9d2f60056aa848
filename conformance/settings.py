"""The suite's settings, resolved once: command line, then environment, then the machine.

Each option is declared here once (:data:`OPTIONS`) and read from one place
(:func:`resolve`). An invalid value raises :class:`SettingsError`, whose message
says where the value came from (``--world-size`` or ``CONFORM_WORLD_SIZE``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["OPTIONS", "Settings", "SettingsError", "resolve"]


#: Seconds a case may run before it is declared hung.
DEFAULT_CASE_TIMEOUT_S = 60.0
#: Generated hard-input examples per case (on top of the named explicit ones).
DEFAULT_HYPOTHESIS_EXAMPLES = 3


class SettingsError(ValueError):
    """A setting has an invalid value; the message names its source and a fix."""


@dataclasses.dataclass(frozen=True)
class Option:
    flag: str
    env: Optional[str]
    help: str
    dest: str


OPTIONS: Tuple[Option, ...] = (
    Option("--hook", "CONFORM_HOOKS", "hook spec to test, as module:ATTR (repeatable; env: space-separated)", "conform_hooks"),
    Option("--with-builtins", None, "also test PyTorch's built-in hooks when --hook is given", "conform_with_builtins"),
    Option("--no-entry-points", None, "ignore specs offered through the 'conformance.hooks' entry points", "conform_no_entry_points"),
    Option("--world-size", "CONFORM_WORLD_SIZE", "ranks in the main pool (default: GPU count with CUDA, else 2)", "conform_world_size"),
    Option("--extra-world-size", "CONFORM_EXTRA_WORLD_SIZE", "a second world size checked too, 0 for none (default: 3, a size that is not a power of two)", "conform_extra_world_size"),
    Option("--backend", "CONFORM_BACKEND", "process group backend: gloo or nccl (default: nccl with CUDA, else gloo)", "conform_backend"),
    Option("--device", "CONFORM_DEVICE", "device of each rank: cpu or cuda (default: cuda if available)", "conform_device"),
    Option("--case-timeout", "CONFORM_CASE_TIMEOUT", "seconds before a case is declared hung (default: 60)", "conform_case_timeout"),
    Option("--hypothesis-examples", "CONFORM_HYPOTHESIS_EXAMPLES", "generated hard-input examples per case (default: 3)", "conform_hypothesis_examples"),
    Option("--known-failures", "CONFORM_KNOWN_FAILURES", "extra known-failures TOML file, on top of the packaged fixtures/known_failures.toml (repeatable; env: os.pathsep-separated)", "conform_known_failures"),
)


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
        case_timeout_s: seconds per case before it counts as hung.
        hypothesis_examples: generated examples per hard-input case.
        known_failures: paths of known-failures files, the packaged one first.
        gpu_count: ``torch.cuda.device_count()`` (0 without CUDA).
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

    @property
    def world_sizes(self) -> Tuple[int, ...]:
        if self.extra_world_size and self.extra_world_size != self.world_size:
            return (self.world_size, self.extra_world_size)
        return (self.world_size,)

    def world_size_unavailable(self, world_size: int) -> Optional[str]:
        """Why a pool of ``world_size`` cannot run here, or ``None`` if it can."""
        if self.device == "cuda" and world_size > self.gpu_count:
            return (f"world size {world_size} needs {world_size} GPUs (one rank per GPU), "
                    f"but this machine has {self.gpu_count}")
        return None

    def rerun_args(self) -> List[str]:
        """Options that reproduce this run's machine settings, as ``[flag, value, ...]``.

        Values that change what a case does or where it runs are always
        spelled out, so the command does not depend on the caller's environment.
        """
        args = ["--world-size", str(self.world_size), "--extra-world-size", str(self.extra_world_size or 0),
                "--backend", self.backend, "--device", self.device]
        if self.case_timeout_s != DEFAULT_CASE_TIMEOUT_S:
            args += ["--case-timeout", f"{self.case_timeout_s:g}"]
        if self.hypothesis_examples != DEFAULT_HYPOTHESIS_EXAMPLES:
            args += ["--hypothesis-examples", str(self.hypothesis_examples)]
        default_kf = os.path.abspath(_default_known_failures())
        for path in self.known_failures:
            if os.path.abspath(path) != default_kf:
                args += ["--known-failures", path]
        return args


def _default_known_failures() -> str:
    from conformance import fixtures

    return os.path.join(os.path.dirname(fixtures.__file__), "known_failures.toml")


def _pick(cli: Any, option: Option, env: Dict[str, str]) -> Tuple[Any, str]:
    if cli not in (None, [], False):
        return cli, option.flag
    if option.env and env.get(option.env, "").strip():
        return env[option.env].strip(), option.env
    return None, ""


def _int(value: Any, source: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SettingsError(f"invalid value {value!r} from {source}: expected an integer") from None
    if number < minimum:
        raise SettingsError(f"invalid value {value!r} from {source}: must be at least {minimum}")
    return number


def resolve(getoption: Callable[[str], Any], env: Optional[Dict[str, str]] = None,
            gpu_count: Optional[int] = None) -> Settings:
    """Resolve every option from ``getoption(dest)``, then ``env``, then the machine.

    Raises:
        SettingsError: an invalid value, or a combination this machine cannot
            run (CUDA without GPUs, NCCL on CPU, more ranks than GPUs).
    """
    env = dict(os.environ) if env is None else env
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    by_dest = {o.dest: o for o in OPTIONS}

    def pick(dest: str) -> Tuple[Any, str]:
        return _pick(getoption(dest), by_dest[dest], env)

    hooks_value, hooks_source = pick("conform_hooks")
    if isinstance(hooks_value, str):
        hooks = tuple(hooks_value.split())
    else:
        hooks = tuple(hooks_value or ())
    with_builtins = bool(getoption("conform_with_builtins"))

    device, device_source = pick("conform_device")
    device = device or ("cuda" if gpu_count else "cpu")
    if device not in ("cpu", "cuda"):
        raise SettingsError(f"invalid device {device!r} from {device_source}: expected cpu or cuda")
    if device == "cuda" and not gpu_count:
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
        world_size = _int(ws_value, ws_source, minimum=1)
        if device == "cuda" and world_size > gpu_count:
            raise SettingsError(
                f"--world-size {world_size} (from {ws_source}) is larger than the GPU count: this machine has "
                f"{gpu_count} GPU(s) (torch.cuda.device_count()), and each rank needs its own GPU. Use "
                f"--world-size {gpu_count}, or --device cpu --backend gloo for CPU ranks.")

    extra_value, extra_source = pick("conform_extra_world_size")
    extra = 3 if extra_value is None else _int(extra_value, extra_source, minimum=0)

    timeout_value, timeout_source = pick("conform_case_timeout")
    try:
        timeout = DEFAULT_CASE_TIMEOUT_S if timeout_value is None else float(timeout_value)
    except ValueError:
        raise SettingsError(f"invalid case timeout {timeout_value!r} from {timeout_source}: expected seconds") from None
    if not math.isfinite(timeout) or timeout <= 0:
        raise SettingsError(f"invalid case timeout {timeout_value!r} from {timeout_source}: must be a positive, finite number of seconds")

    ex_value, ex_source = pick("conform_hypothesis_examples")
    examples = DEFAULT_HYPOTHESIS_EXAMPLES if ex_value is None else _int(ex_value, ex_source, minimum=0)

    kf_value, _ = pick("conform_known_failures")
    if isinstance(kf_value, str):
        extra_files = tuple(kf_value.split(os.pathsep))
    else:
        extra_files = tuple(kf_value or ())
    # The packaged file always applies: it explains PyTorch's own hooks, which a
    # user's file (for their hooks) should not have to repeat.
    default_file = _default_known_failures()
    known = (default_file,) + tuple(f for f in extra_files if os.path.abspath(f) != os.path.abspath(default_file))

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
    )
