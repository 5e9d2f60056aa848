"""The DDP API (``DistributedDataParallel.register_comm_hook``): validation and its suite tests.

DDP calls ``hook(state, bucket)`` once per gradient bucket of a synchronising
backward and expects a ``torch.futures.Future`` of the bucket's new contents.
A spec's cases vary the training configuration (the case field ``config``,
:data:`conformance.apis.ddp.models.CONFIGS`). The rank side (models, configs) is
``models.py``; the reference per claim ``reference.py``; the future contract
and its recorder ``future.py``; the diagnosis's arithmetic ``arithmetic.py``.

Suite tests (``conformance/suite/test_ddp.py``), each a :class:`~conformance.apis.SuiteTest`:

* ``averaging``, ``parity`` (a ``subgroup`` case too), ``rank_consistency``,
  ``hard_inputs``, ``clip_grad_norm``: the shared rank checks
  (:data:`conformance.ranks.checks.SHARED_CHECKS`) over
  :class:`~conformance.apis.ddp.models.DdpModels`;
* ``future_contract``: DDP accepts the bare hook, and every future's value is a
  tensor with the bucket buffer's shape, dtype and device (``ddp.future_contract``,
  this API's own);
* ``lossy_error``, ``lossy_loss``, ``lossy_determinism``: for a hook with
  ``HookSpec(lossy=LossyContract(...))``, instead of the exact checks; it keeps
  rank consistency and the future contract.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

from conformance.apis import CasePlan, HookApi, SuiteTest, called_as, first_cross_rank_world_size, subgroup_world_size
from conformance.apis.ddp.cpp_hooks import CPP_HOOK_NOTE, is_cpp_hook
from conformance.cases import CaseParams


# -- the API: case plans ---------------------------------------------------------------

# (config, model) pairs per world-size role: the main world size gets the spread of real
# training setups; an extra one (3, not a power of two) gets the essentials.
#: Bitwise parity with the reference, for hooks that claim exactness.
PARITY_CASES = (
    ("default", "nested_wrapped"),
    ("default", "transformer_shared"),
    ("small_buckets", "transformer_shared"),
    ("bucket_view", "nested_wrapped"),
    ("static_graph", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "net_flat"),
)
EXTRA_PARITY_CASES = (("default", "nested_wrapped"),)
#: Cross-rank comparison of the gradients.
CONSISTENCY_CASES = (("default", "net_flat"),)
#: The future's value against the bucket buffer: every config, at every world size. The
#: ``gradient_probe`` cases have buckets whose lengths divide by neither 2 nor 3 (94 elements
#: in one bucket, or 3, 1, 5, 21 and 64 in a bucket each), where a padded result shows.
FUTURE_CASES = (
    ("default", "net_flat"),
    ("small_buckets", "nested_wrapped"),
    ("bucket_per_param", "gradient_probe"),
    ("bucket_view", "gradient_probe"),
    ("static_graph", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "gradient_probe"),
)
#: Hard inputs through the probe (exact claims): one bucket, bucket views, a bucket per parameter.
HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_view", "gradient_probe"),
                    ("bucket_per_param", "gradient_probe"))
EXTRA_HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_per_param", "gradient_probe"))
#: clip_grad_norm_ with the hook registered (main world size): one bucket, and a model whose unused
#: parameters have no gradient (find_unused_parameters), as in PyTorch's test_fsdp_clip_grad_norm.py.
CLIP_CASES = (("default", "nested_wrapped"), ("find_unused", "unused_param"))
#: Lossy contracts: relative error and NaN/Inf per step and parameter.
LOSSY_ERROR_CASES = (
    ("default", "transformer_shared"),
    ("small_buckets", "nested_wrapped"),
    ("bucket_view", "net_flat"),
    ("find_unused", "unused_param"),
    ("no_sync", "net_flat"),
)
EXTRA_LOSSY_ERROR_CASES = (("default", "nested_wrapped"),)
#: Steps of the rank-consistency cases (their gradients are compared across ranks after each).
RANK_CONSISTENCY_STEPS = 4
#: The training loss needs a real loss (bounded below): the transformer's cross-entropy.
LOSSY_LOSS_CASES = (("default", "transformer_shared"),)
LOSSY_DETERMINISM_CASES = (("default", "net_flat"),)
_ACROSS_RANKS = "needs at least 2 ranks with different inputs"


def _plan(main: Sequence[Tuple[str, str]], extra: Sequence[Tuple[str, str]] = (), *, first_only: bool = False,
          keep: Callable[[Any], bool] = lambda spec: True, skip_one_rank: Optional[str] = None,
          skip_spec: Callable[[Any], Optional[str]] = lambda spec: None) -> CasePlan:
    """A :data:`~conformance.apis.CasePlan`: per kept spec and world size, the ``(config, model)`` pairs
    of its role (``main`` or ``extra``); only one world size when ``first_only``
    (:func:`~conformance.apis.first_cross_rank_world_size`). ``skip_spec(spec)``: why none of a spec's
    cases can run (``None``: they can)."""

    def plan(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        sizes = (first_cross_rank_world_size(settings.world_sizes),) if first_only else settings.world_sizes
        out = []
        for spec in filter(keep, specs):
            for ws in sizes:
                pairs = main if settings.role(ws) == "main" else extra
                why = skip_spec(spec) or (skip_one_rank if ws < 2 else None)
                out.extend(test.case(spec.name, config, ws, model=model, skip=why) for config, model in pairs)
        return out

    return plan


def _with_subgroup(plan: CasePlan) -> CasePlan:
    """``plan``, plus per kept spec one ``subgroup`` case (``nested_wrapped``) on the smallest even pool of
    at least four ranks: the run's, else the extra pool FSDP2's HSDP starts."""
    def with_subgroup(test: SuiteTest, specs: Sequence[Any], settings: Any) -> List[CaseParams]:
        ws = subgroup_world_size(settings.world_sizes)
        return plan(test, specs, settings) + [test.case(spec.name, "subgroup", ws, model="nested_wrapped")
                                              for spec in specs if _exact(spec)]

    return with_subgroup


def _exact(spec: Any) -> bool:
    return spec.lossy is None


#: A suite test of this API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "ddp", "config")


API = HookApi(
    name="ddp",
    installed_with="DistributedDataParallel.register_comm_hook(state, hook)",
    variant_field="config",
    stateful=True,
    validate=called_as(2, "a DDP hook is called as hook(state, bucket) and returns a torch.futures.Future"),
    builtin_hooks="conformance.apis.ddp.builtin_hooks:DDP_HOOKS",
    default_hook="conformance.apis.ddp.builtin_hooks:default_hook",
    standalone="conformance.apis.ddp.standalone",
    models="conformance.apis.ddp.models:DdpModels",
    checks={"future_contract": "conformance.apis.ddp.future:future_contract"},
    plans={
        "test_ddp_averaging": _test("averaging", "averaging", _plan(
            [("default", "analytic_linear")], [("default", "analytic_linear")], keep=_exact,
            skip_one_rank=_ACROSS_RANKS), kind="exact"),
        "test_ddp_parity": _test("parity", "parity", _with_subgroup(_plan(PARITY_CASES, EXTRA_PARITY_CASES,
                                                                          keep=_exact)), kind="exact"),
        "test_ddp_rank_consistency": _test("rank_consistency", "rank_grads", _plan(
            CONSISTENCY_CASES, CONSISTENCY_CASES, skip_one_rank=_ACROSS_RANKS), kind="across_ranks",
            params={"steps": RANK_CONSISTENCY_STEPS}),
        "test_ddp_future_contract": _test("future_contract", "future_contract", _plan(
            FUTURE_CASES, FUTURE_CASES, skip_spec=lambda spec: CPP_HOOK_NOTE if is_cpp_hook(spec) else None)),
        "test_ddp_hard_inputs": _test("hard_inputs", "hard_inputs", _plan(HARD_INPUT_CASES, EXTRA_HARD_INPUT_CASES,
                                                                          keep=_exact), kind="hard_inputs"),
        "test_ddp_clip_grad_norm": _test("clip_grad_norm", "clip_grad_norm", _plan(CLIP_CASES, keep=_exact)),
        "test_ddp_lossy_error": _test("lossy_error", "lossy_error", _plan(
            LOSSY_ERROR_CASES, EXTRA_LOSSY_ERROR_CASES, keep=lambda sp: not _exact(sp)), kind="lossy_error"),
        "test_ddp_lossy_loss": _test("lossy_loss", "lossy_loss", _plan(
            LOSSY_LOSS_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.loss_margin is not None),
            kind="lossy_loss"),
        "test_ddp_lossy_determinism": _test("lossy_determinism", "lossy_determinism", _plan(
            LOSSY_DETERMINISM_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.deterministic),
            kind="lossy_determinism"),
    },
)
APIS = (API,)
