"""The DDP API (``DistributedDataParallel.register_comm_hook``): validation and its suite tests.

DDP calls ``hook(state, bucket)`` once per gradient bucket of a synchronising
backward and expects a ``torch.futures.Future`` of the bucket's new contents.
A spec's cases vary the training configuration (the case field ``config``,
:data:`conformance.apis.ddp.standalone.CONFIGS`). The rank side (its models) is
``models.py``; the reference per claim ``reference.py``; the future contract
and its recorder ``future.py``; the diagnosis's arithmetic ``arithmetic.py``.

Suite tests (``conformance/suite/test_ddp.py``), each a :class:`~conformance.apis.SuiteTest`:

* ``averaging``, ``parity`` (a ``subgroup`` case too, and the ``batched_grad_copy`` config at the main and the
  extra world size: DDP's other native averaging), ``long_run``, ``rank_consistency``,
  ``hard_inputs``, ``clip_grad_norm``: the shared rank checks
  (:data:`conformance.ranks.checks.common.SHARED_CHECKS`) over
  :class:`~conformance.apis.ddp.models.DdpModels`;
* ``future_contract``: DDP accepts the bare hook, and every future's value is a
  tensor with the bucket buffer's shape, dtype and device (``ddp.future_contract``,
  this API's own);
* ``lossy_error``, ``lossy_loss``, ``lossy_determinism``: for a hook with ``HookSpec(lossy=LossyContract(...))``,
  instead of the exact checks; it keeps rank consistency and the future contract.

With ``--with-compiled-ddp`` (``Settings.with_compiled_ddp``), ``parity`` also
plans the ``compiled_autograd`` config: DDP's python reducer under
``torch.compile`` and compiled autograd, which calls ``hook(state, (grad,
param))`` per parameter and ignores its return value; its native divides by
the world size before the SUM (``compiled.py``). Only a spec with
``compiled_ddp=True`` runs there; every other hook (PyTorch's own, any ``GradBucket`` hook, DDP's C++
built-ins) is skipped with the reason.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch

from conformance.apis import (LONG_RUN_STEPS, TWO_NODES, CasePlan, HookApi, SuiteTest, called_as,
                              first_cross_rank_world_size, simulated_layout_skip, subgroup_world_size,
                              two_node_world_sizes)
from conformance.apis.switches import switch_plan
from conformance.apis.ddp.cpp_hooks import CPP_HOOK_NOTE, is_cpp_hook
from conformance.apis.ddp.native_modes import (NATIVE_MODES, batched_skip, config_of, native_mode_skip,
                                              option_unavailable)
from conformance.apis.ddp.standalone import COMPILED_CONFIG, CONFIGS
from conformance.cases import CaseParams

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

# -- the API: case plans ---------------------------------------------------------------

# (config, model) pairs per world-size role: the main world size gets the spread of real
# training setups; an extra one (3, not a power of two) gets the essentials.
#: Bitwise parity with the reference, for hooks that claim exactness.
PARITY_CASES = (("default", "nested_wrapped"), ("default", "transformer_shared"), ("small_buckets", "transformer_shared"),
                ("bucket_view", "nested_wrapped"), ("static_graph", "net_flat"), ("find_unused", "unused_param"),
                ("skip_unused", "unused_param"), ("no_sync", "net_flat"))
EXTRA_PARITY_CASES = (("default", "nested_wrapped"),)
#: The long run (exact claims; :data:`~conformance.apis.LONG_RUN_STEPS` steps, every one compared, on its own
#: objective, :mod:`conformance.ranks.checks.long_run`): at the main world size (every world size at nightly
#: depth).
LONG_RUN_CASES = (("default", "nested_wrapped"),)
#: The ``compiled_autograd`` config's parity cases (only with ``--with-compiled-ddp``): DDP's python reducer
#: under torch.compile and compiled autograd. Each compiles its two models' forward/backward once (seconds on
#: a CPU); ``nested_wrapped`` has ten parameters of four shapes, each reduced by its own hook call.
COMPILED_PARITY_CASES = ((COMPILED_CONFIG, "nested_wrapped"),)
EXTRA_COMPILED_PARITY_CASES = ((COMPILED_CONFIG, "nested_wrapped"),)
#: The parity cases against DDP's other native (``batched_grad_copy=True``: DDP's own averaging divides the flat
#: bucket, where by default it multiplies each gradient by ``1/world_size``), at the main and the extra world size.
NATIVE_MODE_CASES = (("batched_grad_copy", "nested_wrapped"),)
#: Cross-rank comparison of the gradients.
CONSISTENCY_CASES = (("default", "net_flat"),)
#: The future's value against the bucket buffer: every config, at every world size. The ``gradient_probe`` cases
#: have buckets whose lengths divide by neither 2 nor 3 (94, or 3, 1, 5, 21 and 64), where a padded result shows.
FUTURE_CASES = (
    ("default", "net_flat"),
    ("small_buckets", "nested_wrapped"),
    ("bucket_per_param", "gradient_probe"),
    ("bucket_view", "gradient_probe"),
    ("static_graph", "net_flat"),
    ("find_unused", "unused_param"),
    ("skip_unused", "unused_param"),
    ("no_sync", "gradient_probe"),
)
#: Hard inputs through the probe (exact claims): one bucket, bucket views, a bucket per parameter; and through the
#: probe of production size (``large_probe``: one bucket of 25 MiB), the patterns placed at its ends and
#: power-of-two boundaries (:func:`conformance.controller.hard_examples.placed_examples`).
HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_view", "gradient_probe"),
                    ("bucket_per_param", "gradient_probe"), ("default", "large_probe"))
EXTRA_HARD_INPUT_CASES = (("default", "gradient_probe"), ("bucket_per_param", "gradient_probe"),
                          ("default", "large_probe"))
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

    def plan(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        sizes = (first_cross_rank_world_size(settings.world_sizes),) if first_only else settings.world_sizes
        out = []
        for spec in filter(keep, specs):
            for ws in sizes:
                pairs = main if settings.role(ws) == "main" else extra
                why = skip_spec(spec) or (skip_one_rank if ws < 2 else None)
                out.extend(test.case(spec.name, config_of(spec, config), ws, model=model,
                                     skip=why or batched_skip(spec, config)
                                     or option_unavailable(CONFIGS.get(config, {}), config))
                           for config, model in pairs)
        return once(out)

    return plan


#: The model of the subgroup and topology cases.
TOPOLOGY_MODEL = "nested_wrapped"


def _with_subgroup(plan: CasePlan) -> CasePlan:
    """``plan``, plus per kept spec one ``subgroup`` case (``nested_wrapped``) on the smallest even pool of
    at least four ranks (the run's, else the extra pool FSDP2's HSDP starts), its data-parallel groups across
    two simulated nodes; then the topology cases: DDP in the default config on 2 nodes at each of
    :func:`~conformance.apis.two_node_world_sizes`."""
    def with_subgroup(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        ws = subgroup_world_size(settings.world_sizes)
        why = simulated_layout_skip(settings)
        exact = [spec for spec in specs if _exact(spec)]
        return (plan(test, specs, settings)
                + [test.case(spec.name, "subgroup", ws, model=TOPOLOGY_MODEL, nodes=TWO_NODES,
                             skip=why or batched_skip(spec, "subgroup")) for spec in exact]
                + [test.case(spec.name, config_of(spec, "default"), size, model=TOPOLOGY_MODEL, nodes=TWO_NODES,
                             skip=why or batched_skip(spec, "default"))
                   for spec in exact for size in two_node_world_sizes(settings)])

    return with_subgroup


def _exact(spec: HookSpec) -> bool:
    return spec.lossy is None


def once(cases: List[CaseParams]) -> List[CaseParams]:
    """``cases`` without repeats, in order: a spec meant for the batched copy alone has its ``default`` cases in
    the ``batched_grad_copy`` config, where the plan may hold the same case already."""
    return list(dict.fromkeys(cases))


#: Why PyTorch's own DDP hooks (and any hook that says it takes a ``GradBucket``) have no compiled case.
GRADBUCKET_NOTE = "this hook takes a GradBucket; compiled DDP calls hook(state, (grad, param))"
#: Why a hook whose spec does not say it takes compiled DDP's convention has no compiled case: a GradBucket hook
#: raises there (PyTorch's ``allreduce_hook`` too), which is no failure of the hook.
COMPILED_NOT_DECLARED = ("its spec does not say the hook takes compiled DDP's hook(state, (grad, param)), called "
                         "once per parameter with grad reduced in place (a GradBucket hook is not written for it); "
                         "HookSpec(..., compiled_ddp=True) runs it here")


def compiled_unavailable() -> Optional[str]:
    """Why this torch has no DDP under compiled autograd, or ``None``: read off ``DistributedDataParallel``
    (its python reducer, ``_register_accum_grad_hook``) without importing ``torch._dynamo`` here, which costs
    seconds; what else it needs, each rank checks before it builds the reference
    (:func:`conformance.apis.ddp.compiled.compiled_ddp_missing`)."""
    from torch.nn.parallel import DistributedDataParallel

    if not hasattr(DistributedDataParallel, "_register_accum_grad_hook"):
        return (f"torch {torch.__version__}'s DistributedDataParallel has no python reducer "
                "(optimize_ddp='python_reducer'), so no DDP under compiled autograd")
    return None


def takes_grad_bucket(hook: Callable[..., object]) -> bool:
    """Whether ``hook`` says it takes a ``GradBucket``: its ``bucket`` parameter is annotated
    ``dist.GradBucket`` or it returns a ``torch.futures.Future`` (PyTorch's own hooks are annotated so).
    Annotations as strings (``from __future__ import annotations``) count by their words."""
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return False
    param = sig.parameters.get("bucket")
    marks = [param.annotation if param is not None else inspect.Parameter.empty, sig.return_annotation]
    return any(m is not inspect.Parameter.empty and ("GradBucket" in str(m) or "Future" in str(m)) for m in marks)


def compiled_skip(spec: HookSpec) -> Optional[str]:
    """Why ``spec`` has no ``compiled_autograd`` case that can run (``None``: its cases run): a C++ built-in hook;
    a spec without ``compiled_ddp=True`` (:data:`GRADBUCKET_NOTE` where the hook says it takes a ``GradBucket``,
    :func:`takes_grad_bucket`, else :data:`COMPILED_NOT_DECLARED`): only a hook declared for compiled DDP's
    calling convention is held to it; a reduced-precision claim."""
    if is_cpp_hook(spec):
        return ("a C++ built-in comm hook is registered with DDP's C++ Reducer, which compiled DDP's python reducer "
                "bypasses: DDP would train with its own native averaging and never run the hook")
    if not getattr(spec, "compiled_ddp", False):
        return GRADBUCKET_NOTE if takes_grad_bucket(spec.hook) else COMPILED_NOT_DECLARED
    if spec.reduce_dtype not in (None, torch.float32):
        return ("compiled DDP has no reduced-precision native to compare with: its python reducer reduces every "
                "gradient in its own dtype; only full-precision hooks have compiled_autograd cases")
    return None


def _with_native_modes(plan: CasePlan) -> CasePlan:
    """``plan``, plus every exact spec's :data:`NATIVE_MODE_CASES` at the main and the extra world size, each skipped
    with its reason (:func:`~conformance.apis.ddp.native_modes.native_mode_skip`: a reduced-precision claim, whose
    reference is a hook, the same in either mode; a spec not meant for the batched native; a torch without it)."""
    modes = _plan(NATIVE_MODE_CASES, NATIVE_MODE_CASES, keep=_exact, skip_spec=native_mode_skip)

    def with_native_modes(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        return once(plan(test, specs, settings) + modes(test, specs, settings))

    return with_native_modes


def _with_compiled(plan: CasePlan) -> CasePlan:
    """``plan``, plus with ``--with-compiled-ddp`` the ``compiled_autograd`` parity cases of every exact spec
    (:data:`COMPILED_PARITY_CASES` at the main world size, :data:`EXTRA_COMPILED_PARITY_CASES` at the extra
    one), each skipped with its reason (:func:`compiled_unavailable`, :func:`compiled_skip`)."""
    compiled = _plan(COMPILED_PARITY_CASES, EXTRA_COMPILED_PARITY_CASES, keep=_exact,
                     skip_one_rank="compiled DDP over a single rank reduces nothing, so there is nothing to check",
                     skip_spec=lambda spec: compiled_unavailable() or compiled_skip(spec))

    def with_compiled(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        cases = plan(test, specs, settings)
        return cases + compiled(test, specs, settings) if settings.with_compiled_ddp else cases

    return with_compiled


#: A suite test of this API: ``_test(check, rank_check, plan, kind=..., params=...)``.
_test = functools.partial(SuiteTest, "ddp", "config")



API = HookApi(
    name="ddp",
    installed_with="DistributedDataParallel.register_comm_hook(state, hook)",
    variant_field="config",
    stateful=True,
    validate=called_as(2, "a DDP hook is called as hook(state, bucket) and returns a torch.futures.Future"),
    builtin_hooks="conformance.apis.ddp.builtin_hooks:DDP_HOOKS",
    compiled_convention=True,
    native_modes=NATIVE_MODES,
    catalogue_plan=lambda entry: _plan(  # a check the catalogue plans: its model, default config
        [("default", entry.model)], [("default", entry.model)] if entry.world_sizes == "every" else (),
        keep=entry.for_spec), test_prefix="test_ddp_", check_prefix="",
    models="conformance.apis.ddp.models:DdpModels",
    checks={"future_contract": "conformance.apis.ddp.future:future_contract"},
    plans={
        "test_ddp_averaging": _test("averaging", "averaging", _plan(
            [("default", "analytic_linear")], [("default", "analytic_linear")], keep=_exact,
            skip_one_rank=_ACROSS_RANKS), kind="exact"),
        "test_ddp_parity": _test("parity", "parity", _with_compiled(_with_native_modes(_with_subgroup(_plan(
            PARITY_CASES, EXTRA_PARITY_CASES, keep=_exact)))), kind="exact"),
        "test_ddp_long_run": _test("long_run", "long_run", _plan(LONG_RUN_CASES, keep=_exact), kind="exact",
                                   depth_params=LONG_RUN_STEPS),
        "test_ddp_switches": _test("switches", "long_run", switch_plan(_plan(LONG_RUN_CASES, keep=_exact)),
                                   kind="switches"),
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
            LOSSY_LOSS_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.loss_margin
            is not None), kind="lossy_loss"),
        "test_ddp_lossy_determinism": _test("lossy_determinism", "lossy_determinism", _plan(
            LOSSY_DETERMINISM_CASES, first_only=True, keep=lambda sp: sp.lossy is not None and sp.lossy.deterministic),
            kind="lossy_determinism"),
    },
)
APIS = (API,)
