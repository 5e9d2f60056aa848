"""Rank-side checks for ``api="fsdp"``: ``FullyShardedDataParallel.register_comm_hook``.

Every check builds FSDP models on this rank's device in the pool's process
group, trains them for a few SGD steps with rank-dependent inputs, and returns
findings. The reference for each claim is the native FSDP path with no hook:
``_reduce_grad`` / ``_reduce_grad_no_shard`` in
``torch/distributed/fsdp/_runtime_utils.py`` (pre-divide, SUM reduce, post-
divide), run under ``MixedPrecision(reduce_dtype=X)`` for a ``reduce_dtype=X``
claim.

Checks (each registered with :func:`conformance.checks.rank_check`):

* ``fsdp.averaging``: analytic ``Linear(1, world_size)``, input = rank; every
  gradient element must equal ``mean(0..world_size-1)`` exactly.
* ``fsdp.parity``: gradients and parameters bitwise equal to the native path
  after every step; the hook's own output in the parameter dtype.
* ``fsdp.rank_grads``: the hooked model's gradients, returned for a
  cross-rank comparison on the controller (rank consistency).
* ``fsdp.registration``: ``register_comm_hook``'s contract with the hook under test.
* ``fsdp.hard_inputs``: caller-supplied gradients (overflow threshold, zeros,
  NaN/Inf, subnormals), bitwise against the native path.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.checks import rank_check
from conformance.checks.common import (Lockstep, averaging_findings, compare_named, grads_per_step, lockstep, named_grads, named_params, train_alone,
                                       train_step)
from conformance.compare import dtype_name
from conformance.protocol import CheckResult, Finding

def _fsdp():
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    return FullyShardedDataParallel, MixedPrecision, ShardingStrategy


def native_mixed_precision(reduce_dtype: Optional[torch.dtype]) -> Any:
    """``MixedPrecision(reduce_dtype=X)``, the native path a ``reduce_dtype=X`` hook must equal.

    ``_module_classes_to_ignore`` is emptied: by default FSDP puts batch-norm
    modules in their own FSDP units that reduce in full precision, which
    changes the unit structure between the reference and the hooked model and
    is not something a communication hook can (or should) reproduce.
    """
    if reduce_dtype is None:
        return None
    _, MixedPrecision, _ = _fsdp()
    mp = MixedPrecision(reduce_dtype=reduce_dtype)
    if hasattr(mp, "_module_classes_to_ignore"):
        mp = MixedPrecision(reduce_dtype=reduce_dtype, _module_classes_to_ignore=())
    return mp


class HookRecorder:
    """Calls the hook under test and records what it left behind.

    FSDP casts a reduced gradient back to the parameter dtype itself unless the
    registered hook is one of its built-in low-precision hooks
    (``_low_precision_hook_enabled``), so the gradient dtype after backward
    says nothing about the hook. The recorder sees the hook's own output
    (``grad`` for ``NO_SHARD``, ``output`` for sharded strategies) before FSDP
    touches it. It compares equal to the wrapped hook, so FSDP's
    ``state._comm_hook in LOW_PRECISION_HOOKS`` test answers exactly as it
    would for the bare hook and FSDP's behaviour is unchanged.
    """

    def __init__(self, hook: Any):
        self.hook = hook
        self.step = 0
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, state: Any, grad: torch.Tensor, *rest: Any) -> Any:
        result = self.hook(state, grad, *rest)
        out = rest[0] if rest else grad
        self.calls.append({"step": self.step, "dtype": out.dtype, "shape": tuple(out.shape)})
        return result

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.hook or other == self.hook

    def __hash__(self) -> int:
        return hash(self.hook)


def _build(model_name: str, ctx: Any, strategy: str, *, mixed_precision: Any = None,
           use_orig_params: bool = True) -> nn.Module:
    from conformance.models import get_model

    _, _, ShardingStrategy = _fsdp()
    return get_model(model_name).build(
        group=ctx.group,
        device=ctx.device,
        fsdp_kwargs=dict(
            sharding_strategy=ShardingStrategy[strategy],
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
        ),
    )


def _hooked(spec: Any, model_name: str, ctx: Any, strategy: str, **kw: Any):
    model = _build(model_name, ctx, strategy, **kw)
    recorder = HookRecorder(spec.hook)
    model.register_comm_hook(spec.state(ctx.group), recorder)
    return model, recorder


def _recorder_findings(recorder: HookRecorder, model: nn.Module, *, rank: int, step: int) -> List[Finding]:
    param_dtype = next(model.parameters()).dtype
    findings = []
    for call in recorder.calls:
        if call["step"] == step and call["dtype"] != param_dtype:
            findings.append(Finding(
                rank,
                f"the hook left its reduced gradient in {dtype_name(call['dtype'])}, "
                f"but the parameters are {dtype_name(param_dtype)}: a reduced-precision "
                "hook must cast back to the parameter dtype (as LowPrecisionState.parameter_type does); "
                "FSDP only skips its own cast for its built-in fp16/bf16 hooks",
                step=step))
            break
    if not any(c["step"] == step for c in recorder.calls):
        findings.append(Finding(rank, "FSDP never called the hook in this step", step=step))
    return findings


@rank_check("fsdp.averaging")
def averaging(ctx: Any, spec: Any, *, strategy: str, steps: int = 4, lr: float = 0.1) -> List[Finding]:
    """Seed ``test_default_communication_hook_behavior``: grads equal mean(0..world_size-1).

    A hook whose result equals each rank's own local gradient on every rank is
    reported as never communicating (:func:`~conformance.checks.common.averaging_findings`).
    """
    from conformance.models import get_model

    model_cls = get_model("analytic_linear")
    ctx.phase("building the hooked analytic model")
    model, recorder = _hooked(spec, "analytic_linear", ctx, strategy)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    for step in range(steps):
        recorder.step = step
        train_step(ctx, "hooked", step, model, optim, inputs, model_cls.loss)
        findings = averaging_findings(ctx, named_grads(model), step, skip_missing=True)
        if ctx.any_rank(bool(findings)):
            return findings
        optim.step()
    return []


@rank_check("fsdp.parity")
def parity(ctx: Any, spec: Any, *, strategy: str, model: str, steps: int = 3, lr: float = 0.01,
           reference_only: bool = False) -> List[Finding]:
    """Bitwise parity with the native path, gradients and parameters, every step."""
    from conformance.models import get_model

    model_cls = get_model(model)
    ctx.phase("building the reference model (no hook)")
    ref = _build(model, ctx, strategy, mixed_precision=native_mixed_precision(spec.reduce_dtype))
    inputs = model_cls.make_input(ctx.rank, ctx.world_size, ctx.device)
    if reference_only:
        opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        return train_alone(ctx, ref, opt_ref, inputs, model_cls.loss, steps)
    ctx.phase("building the hooked model")
    hooked, recorder = _hooked(spec, model, ctx, strategy)

    def start_step(step: int) -> None:
        recorder.step = step

    return lockstep(ctx, Lockstep(
        ref=ref, hooked=hooked, inputs=inputs, loss_fn=model_cls.loss, reference="the native path",
        grads=[("gradient", named_grads, "")], params=("parameter after the optimizer step", named_params, ""),
        hook_findings=lambda step: _recorder_findings(recorder, hooked, rank=ctx.rank, step=step),
        start_step=start_step), steps=steps, lr=lr)


@rank_check("fsdp.rank_grads")
def rank_grads(ctx: Any, spec: Any, *, strategy: str, model: str, steps: int = 3,
               lr: float = 0.01) -> CheckResult:
    """The hooked model's gradients after each step, for a cross-rank comparison (:func:`grads_per_step`)."""
    from conformance.models import get_model

    model_cls = get_model(model)
    ctx.phase("building the hooked model")
    hooked, recorder = _hooked(spec, model, ctx, strategy)

    def start_step(step: int) -> None:
        recorder.step = step

    return grads_per_step(ctx, hooked, torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9),
                          model_cls.make_input(ctx.rank, ctx.world_size, ctx.device), model_cls.loss, steps,
                          named=named_grads, start_step=start_step)


# -- registration contract ----------------------------------------------------------

_ALREADY = r"^A communication hook is already registered$"
_NON_ROOT = r"^register_comm_hook can only be called on a root instance.$"
_HYBRID = r"Communication hook is not supported for hybrid strategies"

#: The registration rules, from PyTorch's test_fsdp_comm_hooks.py.
REGISTRATION_RULES = (
    "unset_before_registration",
    "reaches_every_unit",
    "second_registration_raises",
    "non_root_raises",
    "preset_submodule_raises",
    "hybrid_strategy_raises",
)


def _expect_raise(ctx: Any, fn: Any, pattern: str, what: str) -> List[Finding]:
    try:
        fn()
    except AssertionError as exc:
        if re.search(pattern, str(exc)):
            return []
        return [Finding(ctx.rank, f"{what} raised AssertionError({str(exc)!r}), expected a message "
                                  f"matching {pattern!r}")]
    except Exception as exc:  # noqa: BLE001
        return [Finding(ctx.rank, f"{what} raised {type(exc).__name__}({exc}), expected AssertionError "
                                  f"matching {pattern!r}")]
    return [Finding(ctx.rank, f"{what} did not raise; expected AssertionError matching {pattern!r}")]


_HYBRID_GROUPS: Dict[int, Any] = {}


def _hybrid_groups(ctx: Any) -> Any:
    """(intra-node, inter-node) process groups for HYBRID_SHARD without one device per node.

    Every rank shards over the whole pool and replicates over a group of its
    own. With FSDP's default (``process_group=None``) a one-device-per-node
    machine turns HYBRID_SHARD into NO_SHARD and the rule would go untested.
    """
    key = id(ctx.group)
    if key not in _HYBRID_GROUPS:
        singles = [dist.new_group([r]) for r in range(ctx.world_size)]
        _HYBRID_GROUPS[key] = (ctx.group, singles[ctx.rank])
    return _HYBRID_GROUPS[key]


@rank_check("fsdp.registration")
def registration(ctx: Any, spec: Any, *, strategy: str, rule: str) -> List[Finding]:
    """One rule of ``FullyShardedDataParallel.register_comm_hook``, with the hook under test."""
    FSDP, _, ShardingStrategy = _fsdp()
    hook = spec.hook
    ctx.phase(f"registration rule {rule}")
    if rule == "hybrid_strategy_raises":
        from conformance.models import get_model

        findings: List[Finding] = []
        for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            base = get_model("net_flat").build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
            model = FSDP(base, process_group=_hybrid_groups(ctx), device_id=ctx.device,
                         sharding_strategy=ShardingStrategy[name],
                         auto_wrap_policy=_linear_wrap_policy())
            if model.sharding_strategy != ShardingStrategy[name]:
                findings.append(Finding(ctx.rank, f"FSDP turned {name} into {model.sharding_strategy.name}; "
                                                  "the hybrid rule could not be exercised"))
                continue
            findings += _expect_raise(ctx, lambda: model.register_comm_hook(spec.state(ctx.group), hook),
                                      _HYBRID, f"register_comm_hook under {name}")
        return findings

    model = _build("net_wrapped", ctx, strategy, use_orig_params=False)
    units = FSDP.fsdp_modules(model)
    submodules = [m for m in units if not m.check_is_root()]
    state = spec.state(ctx.group)
    if rule == "unset_before_registration":
        return [Finding(ctx.rank, f"FSDP unit {i} has _comm_hook={m._comm_hook!r} before registration")
                for i, m in enumerate(units) if m._comm_hook is not None]
    if rule == "reaches_every_unit":
        model.register_comm_hook(state, hook)
        out = []
        for i, m in enumerate(units):
            if m._comm_hook is not hook or m._comm_hook_state is not state:
                out.append(Finding(ctx.rank, f"FSDP unit {i} of {len(units)} holds hook {m._comm_hook!r} and "
                                             f"state {m._comm_hook_state!r} after registering on the root"))
        return out
    if rule == "second_registration_raises":
        model.register_comm_hook(state, hook)
        return _expect_raise(ctx, lambda: model.register_comm_hook(state, hook), _ALREADY,
                             "a second register_comm_hook")
    if rule == "non_root_raises":
        return _expect_raise(ctx, lambda: submodules[-1].register_comm_hook(state, hook), _NON_ROOT,
                             "register_comm_hook on a non-root FSDP unit")
    if rule == "preset_submodule_raises":
        submodules[-1]._comm_hook = hook
        return _expect_raise(ctx, lambda: model.register_comm_hook(state, hook), _ALREADY,
                             "register_comm_hook with a submodule's hook already set")
    raise ValueError(f"unknown registration rule {rule!r}; known: {', '.join(REGISTRATION_RULES)}")


def _linear_wrap_policy() -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({nn.Linear})


# -- hard inputs ----------------------------------------------------------------------

@rank_check("fsdp.hard_inputs")
def hard_inputs(ctx: Any, spec: Any, *, strategy: str, examples: Sequence[Tuple[str, Sequence[Sequence[torch.Tensor]]]],
                lr: float = 0.01) -> List[Finding]:
    """Caller-chosen gradients, bitwise vs native; stops at the first example that differs.

    ``examples`` is a list of ``(label, grads)``; ``grads[rank][i]`` is the
    gradient of probe parameter ``i`` on ``rank`` (float32, CPU). One pair of
    probes (hooked, reference) serves every example: the probe's gradients
    depend only on its input, so each backward yields exactly ``grads``.
    """
    from conformance.models import get_model

    model_cls = get_model("gradient_probe")
    ctx.phase("building the reference probe (no hook)")
    ref = _build("gradient_probe", ctx, strategy, mixed_precision=native_mixed_precision(spec.reduce_dtype))
    ctx.phase("building the hooked probe")
    hooked, recorder = _hooked(spec, "gradient_probe", ctx, strategy)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_hooked = torch.optim.SGD(hooked.parameters(), lr=lr)
    for step, (label, grads) in enumerate(examples):
        recorder.step = step
        inputs = tuple(g.to(ctx.device) for g in grads[ctx.rank])
        train_step(ctx, f"reference ({label} inputs)", step, ref, opt_ref, inputs, model_cls.loss)
        train_step(ctx, f"hooked ({label} inputs)", step, hooked, opt_hooked, inputs, model_cls.loss)
        findings = _recorder_findings(recorder, hooked, rank=ctx.rank, step=step)
        findings += compare_named(f"gradient for the {label!r} inputs", named_grads(hooked), named_grads(ref),
                                   rank=ctx.rank, step=step)
        if ctx.any_rank(bool(findings)):
            return findings
        opt_ref.step()
        opt_hooked.step()
    return []
