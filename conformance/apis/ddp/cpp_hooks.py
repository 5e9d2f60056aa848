"""DDP's C++ built-in comm hooks as specs' hooks, and what the checks record of them.

``DistributedDataParallel._register_builtin_comm_hook(dist.BuiltinCommHookType.X)``
installs a hook that runs inside DDP's C++ reducer (``default_comm_hooks.cpp``):
Python never sees a call, a bucket or a future. A spec names one with
``hook=CppCommHook("ALLREDUCE")`` (or ``"FP16_COMPRESS"``); the DDP models
register it that way, the future contract does not apply (its cases are
skipped with that reason), and the diagnosis has no call to recompute, which
every gradient finding says (:class:`conformance.apis.ddp.recorder.CppHookRecorder`).
Only ``torch.distributed`` is imported here: the controller plans with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

__all__ = ["CPP_HOOK_NOTE", "CppCommHook", "is_cpp_hook"]

#: Why a C++ built-in hook has no future contract case, and no diagnosis.
CPP_HOOK_NOTE = ("a C++ built-in comm hook runs inside DDP's reducer: no Python call, bucket or future to record "
                 "(no future contract, no diagnosis)")


class CppCommHook:
    """One of DDP's C++ built-in comm hooks, ``dist.BuiltinCommHookType.<type_name>``, as a spec's ``hook``.

    DDP runs it inside its C++ reducer, registered with
    ``DistributedDataParallel._register_builtin_comm_hook(hook_type)``, never as a
    Python call: the DDP models register it that way
    (:class:`conformance.apis.ddp.models.DdpModels`), the future contract does not
    apply, and the diagnosis has no hook call to recompute. ``ALLREDUCE`` divides
    the bucket by the world size, then SUM all-reduces it (``AllReduceCommHook``
    in ``default_comm_hooks.cpp``), as ``allreduce_hook`` does; ``FP16_COMPRESS``
    casts to float16 first and back after, as ``fp16_compress_hook`` does.

    Raises:
        RuntimeError: when called from Python (nothing in the suite calls it).
    """

    #: Why a standalone reproducer (:mod:`conformance.reproducers`) cannot replay it: it has no Python call.
    no_reproducer = "DDP's C++ built-in hooks run inside the reducer, with no Python call to replay standalone"
    #: Why none of its code can be measured (:mod:`conformance.ranks.hook_code`): it is C++.
    not_python = "a C++ built-in hook: DDP runs it inside its reducer (default_comm_hooks.cpp), no Python code"

    def __init__(self, type_name: str):
        self.type_name = type_name
        self.__name__ = self.__qualname__ = f"BuiltinCommHookType.{type_name}"

    def hook_type(self) -> Any:
        """``torch.distributed.BuiltinCommHookType.<type_name>``."""
        return getattr(dist.BuiltinCommHookType, self.type_name)

    def __call__(self, state: object, bucket: object) -> Any:
        raise RuntimeError(f"{self.__name__} is DDP's C++ built-in comm hook: register it with "
                           f"DistributedDataParallel._register_builtin_comm_hook, not register_comm_hook")

    def __repr__(self) -> str:
        return f"CppCommHook({self.type_name!r})"


def is_cpp_hook(spec: HookSpec) -> bool:
    """Whether ``spec``'s hook is one of DDP's C++ built-in hooks (:class:`CppCommHook`)."""
    return isinstance(spec.hook, CppCommHook)
