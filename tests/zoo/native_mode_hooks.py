"""Hooks written for one of their API's natives (issue 45).

DDP: ``DistributedDataParallel`` by default multiplies each
gradient by ``1/world_size`` as it fills the bucket; with ``batched_grad_copy=True`` (torch 2.13+) it divides the
flat bucket by the world size. At 3 ranks the two differ in the last bit, so a hook is exact for one of them.

* ``good_reciprocal_default_native``: ``x (1/N)``, SUM: DDP's default native; its spec names no mode, so its
  batched-copy cases are skipped with the reason.
* ``good_divides_batched_native``: ``/ N``, SUM (``allreduce_hook``'s arithmetic), meant for the batched copy
  (``native_modes=("batched_grad_copy",)``): its cases against the default native are skipped with the reason.
* ``bad_reciprocal_in_batched_native`` and ``bad_divides_in_default_native``: the same two hooks claiming both
  natives; each is caught at 3 ranks in the mode it does not match, its cause named by that mode's arithmetic.

FSDP2: by default FSDP2 hands a reduce-scatter comm ``AVG`` (float32, bfloat16); under
``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` (the ``sum_no_divide``
native, which a framework that scales its gradients itself runs) it hands ``SUM`` and divides nothing.

* ``good_sum_only_comm``: accepts only ``SUM`` and raises otherwise, as a published bf16-wire comm does; meant for
  ``sum_no_divide`` alone, its default cases run in that config instead, its other configs skipped with the
  reason.
* ``good_always_sum_sum_native``: SUMs whatever op it is handed; meant for ``sum_no_divide``: exact there.
* ``bad_always_sum_in_default_native``: the same comm claiming both natives: caught in the default config (FSDP2
  hands it ``AVG``), its cause a SUM without averaging.
* ``good_accumulation_only_comm``: a plain comm meant for FSDP2 under gradient accumulation alone
  (``native_modes=("accumulation",)``): its accumulation cases run, every other test's are skipped with the
  reason.

Only ``torch`` is imported (and the suite's ``HookSpec``): the zoo is imported by the controller and every rank.
"""

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec


def process_group_state(process_group: Any) -> Any:
    return process_group


def reciprocal_then_sum(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bucket x (1/N)``, then a SUM all-reduce: default DDP's arithmetic."""
    buffer = bucket.buffer().mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


def divide_then_sum(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bucket / N``, then a SUM all-reduce: DDP's with ``batched_grad_copy=True`` (and ``allreduce_hook``'s)."""
    buffer = bucket.buffer().div_(process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])


BOTH = ("default", "batched_grad_copy")

#: The non-deprecated reduce-scatter where torch has it (2.13), else the one older torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AlwaysSum:
    """A reduce-scatter comm that SUMs whatever ``op`` FSDP2 hands it (its buffers from ``torch.empty``)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return _reduce_scatter(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class PassOp(AlwaysSum):
    """A reduce-scatter comm that passes on the op FSDP2 hands it."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class SumOnly(AlwaysSum):
    """A reduce-scatter comm that accepts only ``SUM``, as a comm built for a framework that calls
    ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` does."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"this comm only supports ReduceOp.SUM, got {op}")
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


SUM_NATIVE = ("sum_no_divide",)

KNOWN_GOOD: List[HookSpec] = [
    HookSpec(name="good_reciprocal_default_native", api="ddp", hook=reciprocal_then_sum, state=process_group_state,
             description="x 1/world_size, SUM: DDP's default native"),
    HookSpec(name="good_divides_batched_native", api="ddp", hook=divide_then_sum, state=process_group_state,
             native_modes=("batched_grad_copy",), description="/ world_size, SUM: DDP(batched_grad_copy=True)"),
    HookSpec(name="good_sum_only_comm", api="fsdp2", hook=SumOnly, native_modes=SUM_NATIVE,
             description="a comm that raises on any op but SUM, meant for FSDP2's sum_no_divide native"),
    HookSpec(name="good_always_sum_sum_native", api="fsdp2", hook=AlwaysSum, native_modes=SUM_NATIVE,
             description="a comm that SUMs whatever op it is handed, meant for FSDP2's sum_no_divide native"),
    HookSpec(name="good_accumulation_only_comm", api="fsdp2", hook=PassOp, native_modes=("accumulation",),
             description="a comm that passes the op on, meant for FSDP2 under gradient accumulation alone"),
]
KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_reciprocal_in_batched_native", api="ddp", hook=reciprocal_then_sum, state=process_group_state,
             native_modes=BOTH, description="x 1/world_size, SUM, claiming the batched copy's native too"),
    HookSpec(name="bad_divides_in_default_native", api="ddp", hook=divide_then_sum, state=process_group_state,
             native_modes=BOTH, description="/ world_size, SUM, claiming DDP's default native too"),
    HookSpec(name="bad_always_sum_in_default_native", api="fsdp2", hook=AlwaysSum,
             native_modes=("default", "sum_no_divide"),
             description="a comm that SUMs whatever op it is handed, claiming FSDP2's default native too"),
]
ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

EXPECTED_CATCH: Dict[str, str] = {
    "bad_reciprocal_in_batched_native": ("parity in the batched_grad_copy config at 3 ranks: x * (1/3) where DDP "
                                         "with batched_grad_copy=True divides by 3 (the default configs pass)"),
    "bad_divides_in_default_native": ("parity in the default config at 3 ranks: x / 3 where default DDP multiplies "
                                      "by 1/3 (the batched_grad_copy config passes)"),
    "bad_always_sum_in_default_native": ("parity in the default config: FSDP2 hands the comm AVG there, and it SUMs "
                                         "(the sum_no_divide config passes)"),
}
