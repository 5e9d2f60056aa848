"""The FSDP1 API's rank side: its models (:class:`FsdpModels`), its recorder, its native mixed precision.

Every shared check (:mod:`conformance.ranks.checks.exact`, ``clip``, ``probe``,
``lossy``) builds FSDP models through :class:`FsdpModels` on this rank's device
in the pool's process group (or a data-parallel subgroup). The reference for
each claim is the native FSDP path with no hook: ``_reduce_grad`` /
``_reduce_grad_no_shard`` in ``torch/distributed/fsdp/_runtime_utils.py``
(pre-divide, SUM reduce, post-divide), under ``MixedPrecision(reduce_dtype=X)``
for a ``reduce_dtype=X`` claim. The hook is registered through a
:class:`HookRecorder`, which sees its own output before FSDP touches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

from conformance.apis.fsdp.arithmetic import FsdpArithmetic
# The mixed-precision settings live in the API's standalone part, of which reproducers copy what a case runs.
from conformance.apis.fsdp.standalone import low_precision_grads_mixed_precision, native_mixed_precision
from conformance.models import get_model
from conformance.protocol import Finding, FindingKind
from conformance.ranks import hook_code, reach
from conformance.ranks.checks.common import named_grads, named_params
from conformance.shared.standalone_compare import fqn_without_wrappers
from conformance.ranks.checks.groups import on_subgroup
from conformance.ranks.checks.models import ApiModels, Built, Recorder
from conformance.ulps import dtype_name
from conformance.ranks.hook_call import CallLog, HookCall, counting_collectives

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec


def build_fsdp(model_name: str, ctx: CheckContext, strategy: str, *, mixed_precision: Optional[MixedPrecision] = None,
               use_orig_params: bool = True) -> nn.Module:
    """``model_name`` wrapped by FSDP under ``strategy`` in ``ctx.group``, its units as the model defines them."""
    return get_model(model_name).build(
        group=ctx.group,
        device=ctx.device,
        fsdp_kwargs=dict(
            sharding_strategy=ShardingStrategy[strategy],
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
        ),
    )


class HookRecorder(Recorder):
    """Calls the hook under test and records what it left behind.

    FSDP casts a reduced gradient back to the parameter dtype itself unless the
    registered hook is one of its built-in low-precision hooks
    (``_low_precision_hook_enabled``), so the gradient dtype after backward
    says nothing about the hook. The recorder sees the hook's own output
    (``grad`` for ``NO_SHARD``, ``output`` for sharded strategies) before FSDP
    touches it. It compares equal to the wrapped hook, so FSDP's
    ``state._comm_hook in LOW_PRECISION_HOOKS`` test answers exactly as it
    would for the bare hook and FSDP's behaviour is unchanged.

    Args:
        hook: the hook under test.
        rank: this rank, for findings.
        param_dtype: the dtype the hook's output must be in (the parameters', or
            ``MixedPrecision.param_dtype`` under mixed precision).
    """

    def __init__(self, hook: Callable[..., object], rank: int, param_dtype: torch.dtype):
        self.hook = hook
        self.rank = rank
        self.param_dtype = param_dtype
        self.step = 0
        self.calls: List[Dict[str, Any]] = []
        self.log = CallLog()

    def __call__(self, state: object, grad: torch.Tensor, *rest: torch.Tensor) -> Any:
        index = sum(1 for c in self.calls if c["step"] == self.step)
        reach.saw_buffer(grad)
        call_dtype = grad.dtype  # what FSDP handed the hook: what its result must be cast back to
        out = rest[0] if rest else grad
        if self.recording:
            call = self.log.add(HookCall(self.step, index, f"call {index} ({grad.numel()} elements)",
                                         grad.detach().reshape(-1).clone(), sharded=bool(rest)))
            with counting_collectives() as count, hook_code.running(self.hook):
                result = self.hook(state, grad, *rest)
            call.output, call.collectives = out.detach().reshape(-1).clone(), count.issued
            call.group_sizes = tuple(count.group_sizes)
        else:
            with hook_code.running(self.hook):
                result = self.hook(state, grad, *rest)
        self.calls.append({"step": self.step, "dtype": out.dtype, "shape": tuple(out.shape), "arrived": call_dtype})
        return result

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.hook or other == self.hook

    def __hash__(self) -> int:
        return hash(self.hook)

    def findings_so_far(self, step: int) -> List[Finding]:
        """The hook's output left in a dtype other than :attr:`param_dtype` in ``step``."""
        for call in self.calls:
            if call["step"] == step and call["dtype"] != self.param_dtype:
                arrived = dtype_name(call["arrived"])
                return [Finding(
                    self.rank,
                    f"the hook left its reduced gradient in {dtype_name(call['dtype'])}, but it arrived in "
                    f"{arrived} and the parameters are {dtype_name(self.param_dtype)} (FSDP only skips its own "
                    f"cast for its built-in fp16/bf16 hooks); fix: cast the result back to the dtype the gradient "
                    f"arrived in, {arrived}, not to LowPrecisionState.parameter_type, which is the module's "
                    "original dtype even where MixedPrecision(param_dtype=...) trains in another",
                    step=step, kind=FindingKind.CONTRACT)]
        return []

    def findings(self, step: int) -> List[Finding]:
        """:meth:`findings_so_far`, and a finished step in which FSDP never called the hook."""
        findings = self.findings_so_far(step)
        if not any(c["step"] == step for c in self.calls):
            findings.append(Finding(self.rank, "FSDP never called the hook in this step", step=step,
                                    kind=FindingKind.CONTRACT))
        return findings


def _summoned(model: nn.Module, with_grads: bool) -> Dict[str, Optional[torch.Tensor]]:
    """Every parameter (``with_grads``: its gradient) unsharded, by FQN, copied out of
    ``FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=...)``.

    Collective (all-gathers over each FSDP unit's process group), so every rank calls it at the same point.
    ``with_grads`` needs ``use_orig_params=True``, which :func:`build_fsdp` sets; under ``NO_SHARD`` it
    gathers nothing. A gradient FSDP leaves as ``None`` on every rank stays ``None``.
    """
    with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=with_grads):
        out: Dict[str, Optional[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            t = p.grad if with_grads else p
            out[fqn_without_wrappers(name)] = None if t is None else t.detach().clone()
        return out


class FsdpModels(ApiModels):
    """FSDP1 models of a case under ``strategy`` (a ``ShardingStrategy`` name), ``use_orig_params=True``.

    Args:
        ctx, spec, model: as :class:`~conformance.ranks.checks.models.ApiModels`.
        strategy: the case's sharding strategy.
        low_precision_grads: both models under :func:`low_precision_grads_mixed_precision` (PyTorch's
            ``test_low_precision_grads``: float16 gradients kept, so a clipped total norm is float16 too).
        subgroup: both models, and the hook's state, on this rank's data-parallel subgroup
            (:func:`~conformance.ranks.checks.groups.on_subgroup`), not WORLD.
        micro_steps: backward passes per step, all but the last under ``FullyShardedDataParallel.no_sync()``
            (gradient accumulation: FSDP calls no hook there and keeps the unsharded gradients, then calls
            the hook once per flat parameter on the synchronising backward, with their local sum).

    The hook's state is ``spec.state(ctx.group)``. Full gradients of the sharded strategies are gathered with
    ``summon_full_params(with_grads=True)`` (:func:`_summoned`): a lossy contract bounds each parameter's
    relative error, and a shard's (or a flat parameter's) is another number; under ``NO_SHARD`` every rank
    holds them whole already. ``clip_grad_norm_`` is FSDP's own, whose rule for a rank without gradients
    (a float32 zero and a warning) is checked too.
    """

    empty_shards = True
    clips_without_backward = True
    reference = "the native path"
    grad_views = [("gradient", named_grads, "")]
    param_view = ("parameter after the optimizer step", named_params, "")

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, strategy: str,
                 low_precision_grads: bool = False, subgroup: bool = False, micro_steps: int = 1):
        self.micro_steps = micro_steps
        super().__init__(on_subgroup(ctx) if subgroup else ctx, spec, model)
        self.strategy = strategy
        if low_precision_grads:
            self.mixed_precision = self.hooked_mixed_precision = low_precision_grads_mixed_precision()
        elif spec.param_dtype is not None:  # both train in the claimed dtype; the hook gets FSDP's reduce dtype
            self.mixed_precision = self.hooked_mixed_precision = native_mixed_precision(spec.reduce_dtype,
                                                                                        spec.param_dtype)
            self.reference = f"{self.reference} with MixedPrecision(param_dtype={dtype_name(spec.param_dtype)})"
        else:
            self.mixed_precision, self.hooked_mixed_precision = native_mixed_precision(spec.reduce_dtype), None
        self.arithmetic = FsdpArithmetic(self.ctx.world_size, spec.reduce_dtype)

    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        ctx = self.ctx
        if not hooked:
            ctx.phase(f"building the reference {self.noun} (no hook)")
            mixed = None if full_precision else self.mixed_precision
            return Built(build_fsdp(self.model_name, ctx, self.strategy, mixed_precision=mixed))
        ctx.phase(f"building the hooked {self.noun}")
        model = build_fsdp(self.model_name, ctx, self.strategy, mixed_precision=self.hooked_mixed_precision)
        mixed = self.hooked_mixed_precision  # FSDP hands the hook its reduce dtype (the parameter dtype's by default)
        param_dtype = (getattr(mixed, "reduce_dtype", None) or getattr(mixed, "param_dtype", None)
                       or next(model.parameters()).dtype)
        recorder = HookRecorder(self.spec.hook, ctx.rank, param_dtype)
        model.register_comm_hook(hook_code.state_of(self.spec, ctx.group), recorder)
        return Built(model, recorder)

    def full_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        # Already unsharded under NO_SHARD: every rank holds whole gradients, no all-gather needed.
        return named_grads(model) if self.strategy == "NO_SHARD" else _summoned(model, with_grads=True)

    def full_params(self, model: nn.Module) -> Dict[str, Any]:
        return named_params(model) if self.strategy == "NO_SHARD" else _summoned(model, with_grads=False)

    def clip(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """``FullyShardedDataParallel.clip_grad_norm_``, FSDP's own (it all-reduces the shards' norms)."""
        return model.clip_grad_norm_(max_norm, norm_type)
