"""A zoo of DDP gradient communication hooks: known-good and known-bad.

The meta-tests (``tests/meta_zoos/``'s ``DDP``: the shared ones in ``tests/test_meta.py``, the
DDP-only ones in ``tests/test_meta_ddp.py``) run the DDP checks over these hooks. Each
known-good hook must pass every case; each known-bad hook must be caught by the checks
named in ``EXPECTED_CATCH`` (which also says why no weaker check can).

What "good" means is fixed by DDP itself (``torch/csrc/distributed/c10d/reducer.cpp``):
with no hook, the reducer multiplies each gradient by ``1 / world_size`` as it copies it
into the bucket (``at::mul_out(bucket_view, grad, wrapped_scalar_tensor(1. / div_factor))``)
and SUM-all-reduces the bucket. With a hook registered it copies the gradients in
unscaled, calls ``hook(state, bucket)`` and copies the future's value back into the
gradients. A full-precision hook that reproduces DDP bit for bit therefore multiplies by
the reciprocal, then SUM-reduces; dividing by the world size instead (what PyTorch's
``allreduce_hook`` does) is 1 ULP off at world sizes that are not powers of two.

DDP's ``register_comm_hook`` reads the hook's ``__name__`` and ``__qualname__`` and looks
its second parameter up by the name ``bucket``: a callable object must carry both names,
and every hook here calls its second parameter ``bucket``.
The zoo is one module per class of hook, each holding its hooks, their ``HookSpec`` s and, for the bad ones,
what must catch each: ``good.py`` (known-good), ``arithmetic.py`` (a wrong reduction), ``contract.py`` (a broken
``Future`` contract), ``lossy.py`` (lossy hooks, declared or not) and ``global_state.py`` (state kept at module
level, carried into a second model). This module gathers them (``KNOWN_GOOD``,
``KNOWN_BAD``, ``ALL``, ``EXPECTED_CATCH``); specs are named by its path, ``tests.zoo.ddp_hooks:ALL``.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

from conformance.spec import HookSpec
from tests.zoo.ddp_hooks import arithmetic, contract, global_state, lossy
from tests.zoo.ddp_hooks.arithmetic import _done, StaleState  # noqa: F401 (read by tests/zoo/fixed_twins.py)
from tests.zoo.ddp_hooks.good import GENEROUS_FP16, KNOWN_GOOD, no_state  # noqa: F401 (GENEROUS_FP16: fixed_twins.py)
from tests.zoo.ddp_hooks.lossy import bad_bf16_undeclared  # noqa: F401 (read by tests/zoo/fixed_twins.py)
from tests.zoo.plain_hooks import mean_allreduce as _mean_allreduce  # noqa: F401 (read by tests/zoo/fixed_twins.py)
from tests.zoo.plain_hooks import process_group_state

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "no_state", "process_group_state"]

_BAD = {spec.name: spec
        for spec in arithmetic.KNOWN_BAD + contract.KNOWN_BAD + lossy.KNOWN_BAD + global_state.KNOWN_BAD}
#: The order the suite runs the known-bad hooks in: the order of the one module this package was split from.
_BAD_ORDER = (
    "bad_sum_no_average",
    "bad_wrong_dtype",
    "bad_stale_second_step",
    "bad_divides_by_world_size",
    "bad_returns_list",
    "bad_averages_param_grads",
    "bad_sum_then_divide",
    "bad_returns_none",
    "bad_returns_tensor",
    "bad_rank_order_mean",
    "bad_ring_no_average_tail",
    "bad_rs_ag_tail_unreduced",
    "bad_world_size_divisor",
    "bad_wrong_shape",
    "bad_padded_future",
    "bad_nan_to_zero",
    "bad_default_group",
    "bad_saturates_inf_off_rank0",
    "bad_fp16_divide_after",
    "bad_fp16_cast_back_then_divide",
    "bad_fp16_rescues_tiny_buckets",
    "bad_param_not_named_bucket",
    "bad_noop_hook",
    "bad_lossy_undeclared",
    "bad_bf16_undeclared",
    "bad_lossy_exceeds_bound",
    "bad_lossy_nan",
    "bad_lossy_rank_dependent",
    "bad_lossy_nondeterministic",
    "bad_lossy_diverges",
    "bad_static_buffers_after_warm_up",
)
assert set(_BAD_ORDER) == set(_BAD), "every known-bad DDP hook is named once in _BAD_ORDER"

KNOWN_BAD: List[HookSpec] = [_BAD[name] for name in _BAD_ORDER]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: For each known-bad hook: the checks that must catch it, and why.
EXPECTED_CATCH: Dict[str, str] = {**arithmetic.EXPECTED_CATCH, **contract.EXPECTED_CATCH, **lossy.EXPECTED_CATCH,
                                  **global_state.EXPECTED_CATCH}
