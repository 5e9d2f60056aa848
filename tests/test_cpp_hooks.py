"""DDP's C++ built-in comm hooks as specs: what the plans and the spec checks make of a CppCommHook."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from conformance import HookSpec
from conformance.apis.ddp.builtin_hooks import DDP_HOOKS, no_state
from conformance.apis.ddp.cpp_hooks import CPP_HOOK_NOTE, CppCommHook, is_cpp_hook
from conformance.apis.registry import planned_cases
from tests.meta_helpers import plan_settings


def test_each_builtin_type_resolves_and_python_never_calls_it():
    for name in ("ALLREDUCE", "FP16_COMPRESS"):
        hook = CppCommHook(name)
        assert hook.hook_type() is getattr(dist.BuiltinCommHookType, name)
        assert hook.__name__ == f"BuiltinCommHookType.{name}"
        with pytest.raises(RuntimeError, match="_register_builtin_comm_hook"):
            hook(None, None)
    with pytest.raises(AttributeError):
        CppCommHook("NO_SUCH_HOOK").hook_type()


def test_pytorchs_cpp_hooks_are_among_the_builtins_under_test():
    cpp = [s for s in DDP_HOOKS if is_cpp_hook(s)]
    assert {s.name: s.hook.type_name for s in cpp} == {"ddp_cpp_allreduce": "ALLREDUCE",
                                                      "ddp_cpp_fp16_compress": "FP16_COMPRESS"}


def test_a_cpp_hook_gets_every_check_but_the_future_contract_which_says_why():
    spec = HookSpec(name="mine", api="ddp", hook=CppCommHook("ALLREDUCE"), state=no_state,
                    native_modes=("default", "batched_grad_copy"))  # every parity case: both of DDP's natives
    settings = plan_settings(2, 3)
    future = planned_cases("test_ddp_future_contract", [spec], settings)
    assert future and all(c.skip == CPP_HOOK_NOTE for c in future)
    parity = planned_cases("test_ddp_parity", [spec], settings)
    assert parity and all(c.skip is None for c in parity)
    # A Python hook's future contract runs.
    python = HookSpec(name="py", api="ddp", hook=lambda state, bucket: None, state=no_state)
    assert all(c.skip is None for c in planned_cases("test_ddp_future_contract", [python], settings))
