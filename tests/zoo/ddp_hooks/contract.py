"""The DDP zoo's known-bad hooks that break the ``Future`` contract ``register_comm_hook`` sets: the wrong dtype or
shape, a list, ``None`` or a tensor for a Future, a padded result, a second parameter not named ``bucket``; each
with its ``HookSpec`` and what must catch it (``EXPECTED_CATCH``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce
from tests.zoo.plain_hooks import process_group_state


def bad_wrong_dtype(process_group, bucket):
    """Averages correctly, then hands back the result as float16 (DDP silently casts it back)."""
    return _mean_allreduce(process_group, bucket.buffer()).then(lambda f: f.value().to(torch.float16))


def bad_returns_list(process_group, bucket):
    """Returns the collective's own future, whose value is a list holding the tensor."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future()


def bad_returns_none(process_group, bucket):
    """Reduces in place and returns nothing (DDP would crash the process on it)."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    dist.all_reduce(buffer, group=process_group)
    return None


def bad_returns_tensor(process_group, bucket):
    """Averages right, then returns the tensor itself instead of a Future holding it (DDP raises
    "must return a torch.futures.Future object, but got torch.Tensor")."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / process_group.size())
    dist.all_reduce(buffer, group=process_group)
    return buffer


def bad_wrong_shape(process_group, bucket):
    """Hands back a copy of the average without its last element."""
    return _mean_allreduce(process_group, bucket.buffer()).then(lambda f: f.value()[:-1].clone())


def bad_padded_future(process_group, bucket):
    """Pads the bucket to a multiple of the world size (as a reduce-scatter based hook must) and returns
    the padded average: right values, but a future longer than the bucket wherever its length does not
    divide evenly. DDP quietly reads the leading elements."""
    buffer = bucket.buffer()
    pad = (-buffer.numel()) % process_group.size()
    padded = torch.cat([buffer, buffer.new_zeros(pad)]) if pad else buffer.clone()
    return _mean_allreduce(process_group, padded)


def bad_param_not_named_bucket(process_group, grads):
    """Correct averaging, but DDP's register_comm_hook looks the parameter up by the name ``bucket``."""
    return _mean_allreduce(process_group, grads.buffer())


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_wrong_dtype", api="ddp", hook=bad_wrong_dtype, state=process_group_state),
    HookSpec(name="bad_returns_list", api="ddp", hook=bad_returns_list, state=process_group_state),
    HookSpec(name="bad_returns_none", api="ddp", hook=bad_returns_none, state=process_group_state),
    HookSpec(name="bad_returns_tensor", api="ddp", hook=bad_returns_tensor, state=process_group_state),
    HookSpec(name="bad_wrong_shape", api="ddp", hook=bad_wrong_shape, state=process_group_state),
    HookSpec(name="bad_padded_future", api="ddp", hook=bad_padded_future, state=process_group_state),
    HookSpec(name="bad_param_not_named_bucket", api="ddp", hook=bad_param_not_named_bucket,
             state=process_group_state),
]

#: For each known-bad hook here: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_wrong_dtype": (
        "future_contract: the future holds float16 for a float32 bucket; parity fails too, through the "
        "fp16 rounding DDP's silent cast back keeps"
    ),
    "bad_returns_list": (
        "future_contract: the future holds [tensor]; every check reports that instead of DDP's "
        "'Unable to cast' error"
    ),
    "bad_returns_none": (
        "future_contract: not a Future, which would crash the rank process inside DDP; every training "
        "check reports the violation instead"
    ),
    "bad_returns_tensor": (
        "future_contract: a Tensor, not a Future; the finding says DDP raises a RuntimeError on it (only None "
        "crashes the process), and no failure offers the LossyContract hint: a broken contract is a bug"
    ),
    "bad_wrong_shape": (
        "future_contract: one element short; DDP reads the missing element from the storage behind the "
        "view without complaint, so parity alone could pass it"
    ),
    "bad_padded_future": (
        "future_contract and parity: a bucket whose length does not divide by the world size comes back "
        "padded; the values DDP reads are right, so only the recorded contract shows it"
    ),
    "bad_param_not_named_bucket": (
        "future_contract: DistributedDataParallel.register_comm_hook raises KeyError('bucket') for the "
        "bare hook (the other checks go through the suite's recorder and pass)"
    ),
}
