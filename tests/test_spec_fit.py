"""A hook that cannot be what its API calls is refused at load, naming the API it fits (issue 48); a hook that
fits, however odd its signature, is never refused.

The walkthrough that found it: a DDP hook given ``api="fsdp"`` failed 27 cases on ``'Tensor' object has no
attribute 'buffer'``, and a ``ReduceScatter`` given ``api="fsdp2_all_gather"`` 13 on ``missing ... 'op'``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from conformance.apis.ddp.cpp_hooks import CppCommHook
from conformance.spec import HookSpec
from conformance.signatures import SpecError


def _state(pg):
    return pg


class ReduceScatterComm:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class AllGatherComm:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class AnyArgsComm:
    """Odd but valid for both: ``__call__(*args, **kwargs)``."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        return None


class DefaultsComm(AllGatherComm):
    """Odd but valid for both: every argument has a default, ``op`` too."""

    def __call__(self, output_tensor=None, input_tensor=None, group=None, op=None, async_op=False):
        return None


def _fsdp_hook(state, grad, output=None, *, scale=1.0):
    return None


class _DdpHooks:
    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future:
        return default_hooks.allreduce_hook(state, bucket)


@pytest.mark.parametrize("api, hook, fits", [
    ("fsdp", default_hooks.allreduce_hook, "it fits api='ddp'"),
    ("fsdp2_replica", default_hooks.allreduce_hook, "it fits api='ddp'"),
    ("fsdp2_all_gather", ReduceScatterComm, "It fits api='fsdp2'"),
    ("fsdp2_all_gather", ReduceScatterComm(), "It fits api='fsdp2'"),
    ("fsdp2", AllGatherComm, "It fits api='fsdp2_all_gather'"),
    ("fsdp2", AllGatherComm(), "It fits api='fsdp2_all_gather'"),
], ids=["ddp_hook_as_fsdp", "ddp_hook_as_replica", "rs_class_as_all_gather", "rs_comm_as_all_gather",
        "ag_class_as_reduce_scatter", "ag_comm_as_reduce_scatter"])
def test_a_hook_that_does_not_fit_its_api_is_refused_naming_the_api_it_fits(api, hook, fits):
    with pytest.raises(SpecError) as raised:
        HookSpec(name="mine", api=api, hook=hook, state=_state)
    assert "'mine'" in str(raised.value) and f"api='{api}'" in str(raised.value)
    assert fits in str(raised.value), str(raised.value)


@pytest.mark.parametrize("api, hook", [
    ("fsdp2", AnyArgsComm), ("fsdp2_all_gather", AnyArgsComm()), ("fsdp2", DefaultsComm()),
    ("fsdp2_all_gather", DefaultsComm), ("fsdp2", lambda: ReduceScatterComm()),  # a factory function
    ("fsdp2", ReduceScatterComm), ("fsdp2_all_gather", AllGatherComm()),
    ("fsdp", functools.partial(_fsdp_hook, scale=2.0)), ("fsdp", _fsdp_hook),
    ("ddp", _DdpHooks().hook), ("ddp", default_hooks.allreduce_hook), ("ddp", CppCommHook("ALLREDUCE")),
    ("fsdp2_replica", lambda state, tensor: None),
], ids=["any_args_class", "any_args_comm", "defaults_comm", "defaults_class", "factory_function", "rs_class",
        "ag_comm", "partial_fsdp_hook", "fsdp_hook_with_defaults", "bound_method_ddp_hook", "pytorch_ddp_hook",
        "cpp_hook", "replica_lambda"])
def test_a_hook_that_fits_is_never_refused_however_odd_its_signature(api, hook):
    spec = HookSpec(name="mine", api=api, hook=hook, state=_state)
    assert spec.hook is hook
