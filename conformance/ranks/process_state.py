"""A fingerprint of a rank's process-global state, and what a hook changed in it (rank side).

A rank process checks one hook only (its pool is forked for that hook, see
:mod:`conformance.controller.local_pool`), so nothing a hook leaves behind can reach another
hook's verdict. It can still reach the hook's *own* later cases: a hook that
calls ``torch.set_default_dtype(torch.float64)`` once makes every later model
of the rank float64, reference included, and a float64 reduction then looks
right. So each rank takes a :class:`Fingerprint` before it loads the hook's
module, and compares after every case; each difference fails that case with a
finding that names it (``the hook left torch.get_default_dtype() ==
torch.float64``), and the pool is rebuilt before the next case.

What is compared (the state a hook can change that changes what the suite
computes or reports):

* torch's global modes: default dtype, grad mode, inference mode, anomaly
  detection, deterministic algorithms (and warn-only), intra-op and inter-op
  thread counts, float32 matmul precision, TF32 and cuDNN flags;
* global ``torch.nn.Module`` hooks (``register_module_forward_hook`` and its
  siblings), by the handles registered;
* every public attribute of ``torch.distributed`` and
  ``torch.distributed.distributed_c10d`` that is a function or class, by
  identity (a monkeypatched ``all_reduce`` stays patched for every later model);
* the default process group: still initialised and the same object (whether it
  still runs a collective is the controller's ping, :meth:`RankPool.run`);
* ``sys.stdout`` and ``sys.stderr`` (the same objects, not closed) and file
  descriptors 1 and 2 (still open, on the same file).

Resident memory (:func:`resident_bytes`) goes to the controller with each case's outcome, which
counts its growth over the hook's cases (:func:`conformance.controller.pools.memory_grown`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.modules import module as torch_module

__all__ = ["Fingerprint", "changes", "release_freed_memory", "resident_bytes", "take"]

#: ``torch.nn.modules.module`` dicts of global hooks, with the function that registers into each.
_GLOBAL_MODULE_HOOKS = (
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_backward_hooks", "register_module_full_backward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
    ("_global_module_registration_hooks", "register_module_module_registration_hook"),
    ("_global_parameter_registration_hooks", "register_module_parameter_registration_hook"),
    ("_global_buffer_registration_hooks", "register_module_buffer_registration_hook"),
)

#: Modules whose public functions and classes must keep their identity.
_DISTRIBUTED_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _modes() -> Dict[str, Any]:
    """``{expression: value}`` of torch's global modes, each read by the expression that names it."""
    probes: List[Tuple[str, Callable[[], Any]]] = [
        ("torch.get_default_dtype()", torch.get_default_dtype),
        ("torch.is_grad_enabled()", torch.is_grad_enabled),
        ("torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled),
        ("torch.is_anomaly_enabled()", torch.is_anomaly_enabled),
        ("torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled),
        ("torch.is_deterministic_algorithms_warn_only_enabled()",
         torch.is_deterministic_algorithms_warn_only_enabled),
        ("torch.get_num_threads()", torch.get_num_threads),
        ("torch.get_num_interop_threads()", torch.get_num_interop_threads),
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
        ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("torch.backends.cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
        ("torch.backends.cudnn.deterministic", lambda: torch.backends.cudnn.deterministic),
        ("torch.backends.cudnn.benchmark", lambda: torch.backends.cudnn.benchmark),
    ]
    out: Dict[str, Any] = {}
    for name, read in probes:
        try:
            out[name] = read()
        except Exception:  # noqa: BLE001 - a mode this torch lacks is not part of its state
            pass
    return out


def _module_hooks() -> Dict[str, Tuple[Any, ...]]:
    return {register: tuple(getattr(torch_module, attr).keys()) for attr, register in _GLOBAL_MODULE_HOOKS
            if isinstance(getattr(torch_module, attr, None), dict)}


def _distributed_callables() -> Dict[str, Any]:
    """``{"torch.distributed.all_reduce": the object, ...}``: the objects themselves, so identity is exact."""
    out: Dict[str, Any] = {}
    for modname in _DISTRIBUTED_MODULES:
        mod = importlib.import_module(modname)
        for name, obj in list(vars(mod).items()):
            if not name.startswith("_") and callable(obj) and not isinstance(obj, type(sys)):
                out[f"{modname}.{name}"] = obj
    return out


def _default_group() -> Optional[dist.ProcessGroup]:
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_group  # optional: a torch built without distributed lacks it

    return _get_default_group()


def _stream(fd: int) -> Any:
    """``(st_dev, st_ino)`` of file descriptor ``fd``, or ``None`` when it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class Fingerprint:
    """Process-global state at one moment (see the module docstring for what it covers)."""

    def __init__(self, modes: Dict[str, Any], module_hooks: Dict[str, Tuple[Any, ...]],
                 distributed: Dict[str, Any], default_group: Optional[dist.ProcessGroup], stdio: Dict[str, Any],
                 fds: Dict[int, Any]):
        self.modes = modes
        self.module_hooks = module_hooks
        self.distributed = distributed
        self.default_group = default_group
        self.stdio = stdio
        self.fds = fds


def take() -> Fingerprint:
    """The fingerprint of this process now."""
    return Fingerprint(
        modes=_modes(), module_hooks=_module_hooks(), distributed=_distributed_callables(),
        default_group=_default_group(), stdio={"sys.stdout": sys.stdout, "sys.stderr": sys.stderr},
        fds={fd: _stream(fd) for fd in (1, 2)})


def _name(obj: object) -> str:
    """Where ``obj`` was defined: its code's own name, file and line (``functools.wraps`` copies the
    name and module of what it wraps, so those would name the original)."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    return f"{type(obj).__module__}.{type(obj).__qualname__} object"


def changes(before: Fingerprint, after: Fingerprint, own_group: Optional[dist.ProcessGroup] = None) -> List[str]:
    """What differs from ``before`` in ``after``, one phrase each (``torch.get_default_dtype() ==
    torch.float64 (it was torch.float32)``); empty when nothing does.

    ``own_group``: the default process group the rank joined after ``before`` was taken (``None``
    when it has none); its absence, or another group in its place, is a change.
    """
    out: List[str] = []
    for name, was in before.modes.items():
        now = after.modes.get(name, was)
        if now != was:
            out.append(f"{name} == {now!r} (it was {was!r})")
    for register, keys in before.module_hooks.items():
        added = [k for k in after.module_hooks.get(register, ()) if k not in keys]
        removed = [k for k in keys if k not in after.module_hooks.get(register, ())]
        if added:
            out.append(f"{len(added)} global module hook(s) registered with torch.nn.modules.module.{register} "
                       "still in place (they run on every model of the process); remove them (handle.remove())")
        if removed:
            out.append(f"{len(removed)} global module hook(s) of torch.nn.modules.module.{register} removed")
    for name, was in before.distributed.items():
        now = after.distributed.get(name)
        if now is None:
            out.append(f"{name} deleted")
        elif now is not was:
            out.append(f"{name} replaced by {_name(now)} (monkeypatched; restore the original before returning)")
    if own_group is not None:
        if after.default_group is None:
            out.append("the default process group destroyed (torch.distributed.destroy_process_group() or "
                       "equivalent): later collectives raise 'Default process group has not been initialized'")
        elif after.default_group is not own_group:
            out.append("the default process group replaced by another (a new init_process_group)")
    for name, was in before.stdio.items():
        now = after.stdio[name]
        if now is not was:
            out.append(f"{name} replaced by {now!r}")
        elif getattr(now, "closed", False):
            out.append(f"{name} closed")
    for fd, was in before.fds.items():
        now = after.fds[fd]
        if now is None and was is not None:
            out.append(f"file descriptor {fd} ({'stdout' if fd == 1 else 'stderr'}) closed")
        elif now != was:
            out.append(f"file descriptor {fd} ({'stdout' if fd == 1 else 'stderr'}) pointed at another file "
                       "(os.dup2 over it)")
    return out


def release_freed_memory() -> None:
    """Give back to the system what the process freed but its C allocator kept (glibc's ``malloc_trim(0)``;
    nothing where there is no glibc). Called after each case, before :func:`resident_bytes`: glibc serves a
    25 MiB buffer freed once from its heap ever after (it raises its mmap threshold to the largest block freed)
    and keeps it when freed again, so a rank that ran the production-sized cases holds a GiB it no longer uses,
    which the memory-growth check would lay at the hook's door."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> Optional[int]:
    """This process's resident memory in bytes (``/proc/self/statm``), or ``None`` where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
