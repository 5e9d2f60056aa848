"""The DDP zoo's known-bad lossy hooks: lossy by design but declared exact, or declared lossy and breaking their
``LossyContract`` (its bound, NaN, rank consistency, determinism, the loss); each with its ``HookSpec`` and what
must catch it (``EXPECTED_CATCH``).

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from conformance.spec import HookSpec, LossyContract
from tests.zoo.ddp_hooks.good import _round_trip_allreduce
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce
from tests.zoo.plain_hooks import process_group_state


def bad_lossy_undeclared(process_group, bucket):
    """An 8-bit quantizing round trip (one scale per bucket) that claims full precision (no ``lossy``
    contract): no exact cause explains it, so the failure offers the LossyContract hint."""
    buffer = bucket.buffer()
    scale = buffer.abs().max().clamp(min=1e-30) / 127
    low = (buffer / scale).round_().clamp_(-127, 127).mul_(scale).div_(process_group.size())

    def back(fut: Any) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=process_group, async_op=True).get_future().then(back)


def bad_bf16_undeclared(process_group, bucket):
    """A bfloat16 round trip that claims full precision: an exact cause ("reduced in bfloat16") explains it,
    so the failure says so and offers no LossyContract (claiming reduce_dtype=bfloat16 is the fix)."""
    return _round_trip_allreduce(process_group, bucket, torch.bfloat16)


def bad_lossy_exceeds_bound(process_group, bucket):
    """A bfloat16 round trip (relative error ~2e-3) declared with rel_error_bound=1e-5."""
    return _round_trip_allreduce(process_group, bucket, torch.bfloat16)


def bad_lossy_nan(process_group, bucket):
    """An fp16 round trip, declared lossy, that writes NaN into the first element of every bucket."""
    def poison(f: Any) -> torch.Tensor:
        value = f.value()
        value[0] = float("nan")
        return value

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(poison)


def bad_lossy_rank_dependent(process_group, bucket):
    """Declared lossy; adds noise proportional to the rank, so ranks disagree after the reduction."""
    rank = process_group.rank()

    def noise(f: Any) -> torch.Tensor:
        return f.value().add_(1e-4 * rank)

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(noise)


_CALLS = [0]


def bad_lossy_nondeterministic(process_group, bucket):
    """Declared deterministic, but perturbs each result by a process-wide call counter: identical on
    every rank within a run, different in a second run from the same seed."""
    _CALLS[0] += 1
    tick = _CALLS[0]

    def perturb(f: Any) -> torch.Tensor:
        return f.value().add_(1e-6 * tick)

    return _round_trip_allreduce(process_group, bucket, torch.float16).then(perturb)


def bad_lossy_diverges(process_group, bucket):
    """Declared lossy with a loose per-step bound, but keeps only the gradients' sign (scaled by
    the mean magnitude), so training drifts from the exact run by more than the declared loss margin."""
    buffer = bucket.buffer()

    def sign_compress(f: Any) -> torch.Tensor:
        mean = f.value()
        return buffer.copy_(mean.sign() * mean.abs().mean())

    return _mean_allreduce(process_group, buffer.clone()).then(sign_compress)

_LOSSY_FINE = LossyContract(rel_error_bound=1e-2, deterministic=True, loss_margin=0.05, loss_steps=4)


KNOWN_BAD: List[HookSpec] = [
    HookSpec(name="bad_lossy_undeclared", api="ddp", hook=bad_lossy_undeclared, state=process_group_state),
    HookSpec(name="bad_bf16_undeclared", api="ddp", hook=bad_bf16_undeclared, state=process_group_state),
    HookSpec(name="bad_lossy_exceeds_bound", api="ddp", hook=bad_lossy_exceeds_bound, state=process_group_state,
             lossy=LossyContract(rel_error_bound=1e-5, loss_margin=0.05, loss_steps=4)),
    HookSpec(name="bad_lossy_nan", api="ddp", hook=bad_lossy_nan, state=process_group_state, lossy=_LOSSY_FINE),
    HookSpec(name="bad_lossy_rank_dependent", api="ddp", hook=bad_lossy_rank_dependent,
             state=process_group_state, lossy=LossyContract(rel_error_bound=None, loss_margin=None)),
    HookSpec(name="bad_lossy_nondeterministic", api="ddp", hook=bad_lossy_nondeterministic,
             state=process_group_state, lossy=LossyContract(rel_error_bound=None, deterministic=True)),
    HookSpec(name="bad_lossy_diverges", api="ddp", hook=bad_lossy_diverges, state=process_group_state,
             lossy=LossyContract(rel_error_bound=None, loss_margin=0.01, loss_steps=10)),
]

#: For each known-bad hook here: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {
    "bad_lossy_undeclared": "parity, with the hint on how to declare a LossyContract (no named cause explains it)",
    "bad_bf16_undeclared": (
        "parity, diagnosed as reduced in bfloat16 where it claims no reduce dtype, and no LossyContract hint"
    ),
    "bad_lossy_exceeds_bound": "lossy_error: bf16 error ~2e-3 against a declared 1e-5, with the observed figure",
    "bad_lossy_nan": "lossy_error: NaN where the exact mean is finite",
    "bad_lossy_rank_dependent": "rank_consistency: ranks differ by 1e-4 * rank after the reduction",
    "bad_lossy_nondeterministic": "lossy_determinism: the second run from the same seed differs",
    "bad_lossy_diverges": "lossy_loss: sign compression trains away from the exact run",
}
