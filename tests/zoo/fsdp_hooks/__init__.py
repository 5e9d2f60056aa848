"""A zoo of FSDP1 gradient communication hooks: known-good and known-bad.

The suite's meta-tests run every check over these hooks. Each known-good hook must pass
every check; each known-bad hook must be caught by at least one, and ``EXPECTED_CATCH``
names the check that must catch it and why no weaker check can.

What "good" means here is fixed by FSDP1 itself (``torch/distributed/fsdp/_runtime_utils.py``):

* full precision (``_reduce_grad`` / ``_reduce_grad_no_shard`` with no hook): divide the
  gradient by ``DefaultState._get_gradient_predivide_factor(world_size)`` (a power of two) if
  it is > 1, reduce with SUM (``all_reduce`` for ``NO_SHARD``, ``reduce_scatter_single`` of
  the padded flat gradient for the sharded strategies), then divide by the post-divide factor
  ``world_size / predivide`` if it is > 1;
* ``MixedPrecision(reduce_dtype=X)``: cast the gradient to ``X`` first
  (``_post_backward_hook``), do all of the above in ``X``, then cast the result back to the
  parameter dtype (``_cast_grad_to_param_dtype``).

A hook registered with ``register_comm_hook`` gets the gradient in the parameter dtype (FSDP
skips its own cast to the reduce dtype when a hook is set), is called as
``hook(state, grad)`` under ``NO_SHARD`` and ``hook(state, grad, output)`` under
``FULL_SHARD``/``SHARD_GRAD_OP``. Every hook here takes ``output=None`` and so serves all three
strategies, except ``bad_wrong_shard``, which has no ``NO_SHARD`` form.

PyTorch's own ``fp16_compress_hook``/``bf16_compress_hook`` raise on CPU (``_decompress``
calls ``record_stream``), so the low-precision good hooks here cast back without it.
The zoo is one module per class of hook, each holding its hooks, their ``HookSpec`` s and, for the bad ones,
what must catch each: ``good.py`` (known-good, and the helpers the others share), ``arithmetic.py`` (wrong
arithmetic), ``communication.py`` (the wrong shard, step, group, or none) and ``lossy.py`` (``LOSSY``: hooks lossy
by design, which declare a ``LossyContract``, run by ``tests/test_meta_lossy.py``, not by the exact zoo run).
This module gathers them (``KNOWN_GOOD``, ``KNOWN_BAD``, ``ALL``, ``EXPECTED_CATCH``, ``LOSSY``); specs are
named by its path, ``tests.zoo.fsdp_hooks:ALL``.

Only ``torch`` and ``torch.distributed`` are imported at module level (and the suite's ``HookSpec``, as every
zoo): the zoo is imported by the controller and by every rank process.
"""

from __future__ import annotations

from typing import Dict, List

from conformance.spec import HookSpec
from tests.zoo.fsdp_hooks import arithmetic, communication
# Read by tests/zoo/fixed_twins.py and tests/zoo/after_return.py, which import them from here.
from tests.zoo.fsdp_hooks.communication import _SHARDED, ReplayState, StaleCachedReduce  # noqa: F401
from tests.zoo.fsdp_hooks.good import KNOWN_GOOD, NativeAveragingHook, _div_if_needed, make_state  # noqa: F401
from tests.zoo.fsdp_hooks.lossy import LOSSY, LOSSY_BAD, LOSSY_EXPECTED, LOSSY_GOOD  # noqa: F401
from tests.zoo.plain_hooks import fsdp_reduce_scatter as _reduce_scatter  # noqa: F401

__all__ = ["ALL", "EXPECTED_CATCH", "KNOWN_BAD", "KNOWN_GOOD", "LOSSY", "LOSSY_EXPECTED", "make_state"]

_BAD = {spec.name: spec for spec in arithmetic.KNOWN_BAD + communication.KNOWN_BAD}
#: The order the suite runs the known-bad hooks in: the order of the one module this package was split from.
_BAD_ORDER = (
    "bad_sum_no_average",
    "bad_divide_after",
    "bad_wrong_shard",
    "bad_stale_after_first_step",
    "bad_no_cast_back",
    "bad_local_only",
    "bad_power_of_two_divisor",
    "bad_rank0_only_noise",
    "bad_sum_then_divide",
    "bad_default_group",
    "bad_nan_to_zero",
    "bad_fp32_accumulate",
)
assert set(_BAD_ORDER) == set(_BAD), "every known-bad FSDP1 hook is named once in _BAD_ORDER"

KNOWN_BAD: List[HookSpec] = [_BAD[name] for name in _BAD_ORDER]

ALL: List[HookSpec] = KNOWN_GOOD + KNOWN_BAD

#: For each known-bad spec, the check that must catch it and why.
EXPECTED_CATCH: Dict[str, str] = {**arithmetic.EXPECTED_CATCH, **communication.EXPECTED_CATCH}
