"""A zoo of DDP comm hooks for compiled DDP (``optimize_ddp = "python_reducer"`` under compiled autograd).

``tests/test_compiled_ddp.py`` runs the suite's ``compiled_autograd`` cases over these hooks
(``--with-compiled-ddp -k compiled``); a hook runs there only where its spec says
``compiled_ddp=True``. There DDP calls ``hook(state, (grad, param))`` once per
parameter, from a post-accumulate-grad hook traced into the backward graph, and ignores what the
hook returns: the hook must leave the reduced gradient in ``grad`` (which is ``param.grad``), in
place. With no hook, DDP's native is ``param.grad / world_size``, then a SUM all-reduce
(``DistributedDataParallel._register_accum_grad_hook``), not eager DDP's ``x 1/world_size``.

The state of every hook here is the process group (``process_group_state``). DDP's
``register_comm_hook`` looks the hook's second parameter up by the name ``bucket`` and compares an
annotation on it with ``dist.GradBucket``: no ``from __future__ import annotations`` in this module,
so the one annotated hook carries the class itself. Only ``torch`` and ``torch.distributed`` are
imported at module level: the zoo is imported by the controller and by every rank process.
"""

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from conformance.spec import HookSpec

__all__ = ["ALL", "EXPECTED", "KNOWN_BAD", "KNOWN_GOOD", "SKIPPED", "process_group_state"]


def process_group_state(process_group: Any) -> Any:
    """Every hook's state: the process group DDP runs on."""
    return process_group


# -- known-good ---------------------------------------------------------------------------------------------

def good_div_then_sum(state, bucket):
    """Compiled DDP's native, in place: divide by the world size, then SUM all-reduce."""
    grad, _param = bucket
    grad.div_(dist.get_world_size(state))
    dist.all_reduce(grad, group=state)


def good_functional_like_native(state, bucket):
    """DDP's own python reducer line for line: ``grad / N``, a functional SUM, copied back into the gradient."""
    grad, _param = bucket
    reduced = fcol.all_reduce(grad / dist.get_world_size(state), "sum", state)
    grad.copy_(reduced)


# -- known-bad ----------------------------------------------------------------------------------------------

def bad_returns_value(state, bucket):
    """Reduces a copy and returns it, as an eager hook hands back its future's value: compiled DDP ignores it."""
    grad, _param = bucket
    reduced = grad / dist.get_world_size(state)
    dist.all_reduce(reduced, group=state)
    return reduced


def bad_eager_order(state, bucket):
    """Eager DDP's C++ Reducer order, ``x 1/N`` then SUM: the same bits as compiled native at 2 ranks, not 3."""
    grad, _param = bucket
    grad.mul_(1.0 / dist.get_world_size(state))
    dist.all_reduce(grad, group=state)


def bad_sum_no_divide(state, bucket):
    """SUM all-reduce and no divide: world_size times the average."""
    grad, _param = bucket
    dist.all_reduce(grad, group=state)


def bad_gradbucket_unannotated(state, bucket):
    """An eager-DDP hook (``allreduce_hook``'s body) with no annotation, whose spec wrongly says compiled_ddp=True:
    it calls ``bucket.buffer()`` on the tuple."""
    tensor = bucket.buffer().div_(dist.get_world_size(state))
    return dist.all_reduce(tensor, group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def bad_second_param_misnamed(state, grad_and_param):
    """Right arithmetic, but DDP's ``register_comm_hook`` finds no parameter named ``bucket`` and refuses it."""
    grad, _param = grad_and_param
    grad.div_(dist.get_world_size(state))
    dist.all_reduce(grad, group=state)


# -- skipped when planned: their specs do not say compiled_ddp=True -----------------------------------------

def annotated_gradbucket_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """An eager-DDP hook annotated as PyTorch's own are: its compiled cases are skipped, with the reason."""
    tensor = bucket.buffer().div_(dist.get_world_size(state))
    return dist.all_reduce(tensor, group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def eager_unannotated_mean(state, bucket):
    """README's DDP example, a right GradBucket hook with no annotation: never written for compiled DDP, whose
    cases of it are skipped (issue 31: it failed them with 'tuple' object has no attribute 'buffer')."""
    tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(state))
    return dist.all_reduce(tensor, group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def _spec(hook: Any, compiled_ddp: bool = True) -> HookSpec:
    return HookSpec(name=hook.__name__, api="ddp", hook=hook, state=process_group_state, compiled_ddp=compiled_ddp,
                    description=(hook.__doc__ or "").strip().splitlines()[0])


#: Every good and bad hook here says it takes compiled DDP's convention (``compiled_ddp=True``), so its cases run.
KNOWN_GOOD: List[HookSpec] = [_spec(good_div_then_sum), _spec(good_functional_like_native)]
KNOWN_BAD: List[HookSpec] = [_spec(h) for h in (bad_returns_value, bad_eager_order, bad_sum_no_divide,
                                                 bad_gradbucket_unannotated, bad_second_param_misnamed)]
SKIPPED: List[HookSpec] = [_spec(h, compiled_ddp=False) for h in (annotated_gradbucket_hook, eager_unannotated_mean)]
ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD + SKIPPED

#: Per known-bad hook: the world sizes whose compiled_autograd case fails, and a text its failure must carry.
EXPECTED: Dict[str, Tuple[Tuple[int, ...], str]] = {
    "bad_returns_value": ((2, 3), "ignores what the hook returns"),
    "bad_eager_order": ((3,), "multiplied by 1/3 before the SUM, as eager DDP's C++ Reducer does"),
    "bad_sum_no_divide": ((2, 3), "SUM without averaging"),
    "bad_gradbucket_unannotated": ((2, 3), "this hook takes a GradBucket; compiled DDP calls hook(state, (grad, "
                                           "param))"),
    "bad_second_param_misnamed": ((2, 3), "it reads the hook's parameter named bucket"),
}
