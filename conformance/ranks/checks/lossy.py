"""Rank-side checks of a :class:`~conformance.spec.LossyContract`: what a lossy hook promises instead of exactness.

A lossy hook (PowerSGD, 8-bit quantization, a bf16 comm that accumulates in
float32) is not held to bitwise parity. It is compared with the exact mean over
ranks of the same local gradients, computed in float64, and held to what its
contract declares. The same three checks serve every API that accepts a
contract (``ddp``, ``fsdp``, ``fsdp2``), registered per API as
``<api>.lossy_error``, ``<api>.lossy_loss`` and ``<api>.lossy_determinism``:

* ``lossy_error``: per step and parameter, the relative error of the full
  (unsharded) gradient against the exact mean (the observed maximum is returned
  as a figure), the declared ``rel_error_bound``, and no NaN/Inf where the exact
  mean has none; plus what the API's recorder saw the hook break (DDP's future
  contract, FSDP1's hook output dtype, FSDP2's ``allocate``). Its last steps give
  the ranks gradients of very different sizes (:func:`rank_scale`), as real
  data-parallel batches can: a quantizer that reads every rank's values in its own
  rank's scale stays inside a bound while the ranks' gradients are alike;
* ``lossy_loss``: the training loss after ``loss_steps`` steps is within the
  declared ``loss_margin`` of the same model under the API with no hook;
* ``lossy_determinism``: two runs from the same seed give bitwise identical
  gradients (each rank's local gradient, or local shard).

The checks know no API: each takes the API's models class and builds the
case's :class:`~conformance.ranks.checks.models.ApiModels`, which say how to
build the hooked model and the no-hook one in full precision, the plain model
whose local gradients feed the exact mean (``model_cls``), and the full
gradients and parameters of a model by FQN. The registry binds them per API,
as every shared check (:data:`conformance.ranks.checks.common.SHARED_CHECKS`).

Where the gradients are sharded (FSDP1 sharded strategies, FSDP2), the
models' ``full_grads`` gathers them (``summon_full_params(with_grads=True)``,
``DTensor.full_tensor()``), so every rank compares whole parameters: the
contract's figure is per parameter, and a shard's relative error is a
different number from its parameter's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.protocol import CheckResult, Finding
from conformance.ranks import cost
from conformance.ranks.checks.common import compare_named, hooked_step, sgd, shared_check, train_step
from conformance.shared.standalone_compare import fqn_without_wrappers
from conformance.catalogue import MOMENTUM
from conformance.ranks.checks.models import ApiModels, MakeModels

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

__all__ = ["exact_mean", "lossy_determinism", "lossy_error", "lossy_loss", "relative_error"]

def _local_grads(ctx: CheckContext, shadow: nn.Module, params: Dict[str, torch.Tensor],
                 inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Callable[..., torch.Tensor]) -> None:
    """Leave this rank's unreduced gradients at ``params`` (FQN -> full parameter) in ``shadow``, a plain
    copy of the model with no data-parallel wrapper.

    A frozen parameter (``requires_grad=False``) the hooked model does not list keeps ``shadow``'s own
    value: both start from the same seed and no optimizer step moves it. On torch 2.13, FSDP1 under
    ``NO_SHARD`` with ``use_orig_params=True`` stops listing the parameters of a unit whose parameters
    are all frozen after the first forward and backward (``nonuniform_req_grad``'s root).

    Raises:
        KeyError: a trainable parameter of ``shadow`` is missing from ``params``.
    """
    with torch.no_grad():
        for name, p in shadow.named_parameters():
            fqn = fqn_without_wrappers(name)
            if fqn not in params and not p.requires_grad:
                continue  # frozen: SGD never moves it (and FSDP1 NO_SHARD stops listing all-frozen units)
            if fqn not in params:
                raise KeyError(f"the hooked model has no parameter {fqn!r} of the plain model "
                               f"(it has {', '.join(sorted(params)) or 'none'})")
            p.copy_(params[fqn].reshape(p.shape))
    for p in shadow.parameters():
        p.grad = None
    for micro in inputs:
        loss_fn(micro, shadow(*micro)).backward()


def exact_mean(ctx: CheckContext, shadow: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The mean over ranks of ``shadow``'s gradients, summed in float64 in one all-reduce over ``ctx.group``.

    Returns ``{fqn: float64 tensor of the parameter's shape, or None}``. A
    gradient that is None on every rank stays None; one that is None on some
    ranks only counts as zeros there.
    """
    named = [(fqn_without_wrappers(n), p) for n, p in shadow.named_parameters()]
    present = torch.tensor([0 if p.grad is None else 1 for _, p in named], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=ctx.group)
    flags = [bool(f) for f in present.tolist()]
    flat = [(torch.zeros(p.numel(), dtype=torch.float64, device=ctx.device) if p.grad is None
             else p.grad.detach().to(torch.float64).reshape(-1))
            for (_, p), flag in zip(named, flags) if flag]
    total = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total, group=ctx.group)
    total /= ctx.world_size
    out: Dict[str, Optional[torch.Tensor]] = {}
    offset = 0
    for (name, p), flag in zip(named, flags):
        if flag:
            out[name] = total[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
        else:
            out[name] = None
    return out


def _scaled(loss_fn: Callable[..., torch.Tensor], factor: float) -> Callable[..., torch.Tensor]:
    """``loss_fn`` times ``factor``: this rank's gradients scaled so."""
    def scaled(*args: object, **kwargs: object) -> torch.Tensor:
        return loss_fn(*args, **kwargs) * factor
    return scaled


def relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """``||actual - exact||_2 / ||exact||_2`` in float64, over finite exact entries; 0/0 = 0, x/0 = inf."""
    a = actual.detach().to(torch.float64).reshape(-1)
    e = exact.detach().to(torch.float64).reshape(-1)
    keep = torch.isfinite(e)
    a, e = a[keep], e[keep]
    if not bool(torch.isfinite(a).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(a - e))
    den = float(torch.linalg.vector_norm(e))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _error_findings(ctx: CheckContext, got: Dict[str, Optional[torch.Tensor]], exact: Dict[str, Optional[torch.Tensor]],
                    step: int, bound: Optional[float], worst: float, at: Optional[Tuple[int, str]]
                    ) -> Tuple[List[Finding], float, Optional[Tuple[int, str]]]:
    """One step's findings of :func:`lossy_error` and the running maximum relative error and where."""
    findings: List[Finding] = []
    for fqn, e in exact.items():
        g = got.get(fqn)
        if e is None and (g is None or not bool(g.any())):
            continue  # unused everywhere: no gradient, or zeros the API filled in
        if e is None or g is None:
            findings.append(Finding(ctx.rank, f"gradient is {'None' if g is None else 'set'} with the hook "
                                              f"but {'None' if e is None else 'set'} without it",
                                    step=step, fqn=fqn))
            continue
        g = g.reshape(e.shape)
        introduced = ~torch.isfinite(g.to(torch.float64)) & torch.isfinite(e)
        if bool(introduced.any()):
            idx = tuple(int(i) for i in introduced.nonzero()[0])
            findings.append(Finding(ctx.rank, f"the hook introduced NaN/Inf where the exact mean is finite: "
                                              f"{int(introduced.sum())} of {g.numel()} elements, first at index "
                                              f"{idx} ({float(g[idx])!r} instead of {float(e[idx])!r})",
                                    step=step, fqn=fqn))
            worst, at = math.inf, (step, fqn)
            continue
        rel = relative_error(g, e)
        if rel > worst or at is None:
            worst, at = max(worst, rel), (step, fqn)
        if bound is not None and rel > bound:
            findings.append(Finding(ctx.rank, f"relative error {rel:.3e} exceeds the declared rel_error_bound "
                                              f"{bound:.3e} (||g_hook - g_exact|| / ||g_exact||, g_exact = exact "
                                              "mean over ranks)", step=step, fqn=fqn))
    return findings, worst, at


def rank_scale(rank: int) -> float:
    """The factor :func:`lossy_error`'s uneven steps scale rank ``rank``'s loss (so its gradients) by: 1 on
    rank 0, 1/100 on odd ranks, 1/10000 on the other even ranks. Real data-parallel batches differ so: one
    rank's gradients can be 100x another's, and a hook that scales or quantizes by its own rank's values
    alone shows it only then. Only smaller, never larger: a float16 wire that holds the even steps' gradients
    holds these (it loses digits of the small ones, which weigh 1/100 or less in the mean)."""
    return 1.0 if rank == 0 else (0.01 if rank % 2 else 1e-4)


@shared_check("lossy_error")
def lossy_error(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int = 6, lr: float = 1e-3,
                uneven_steps: int = 3, **variant: object) -> CheckResult:
    """Per step and parameter: relative error vs the exact mean, the declared bound, no NaN/Inf introduced.

    Each step, a plain copy of the model at the hooked model's current
    parameters computes this rank's local gradients, and their mean over ranks
    in float64 (:func:`exact_mean`) is what the hooked model's full gradient is
    compared with; what the hook's recorder saw it break joins the findings.
    SGD (momentum 0.9) with learning rate ``lr``, ``steps`` steps; then a fresh
    hooked model (and hook state) from the same seed trains ``uneven_steps``
    more, numbered on, whose ranks' gradients differ in size by orders of
    magnitude (each rank's loss times :func:`rank_scale`). Fresh, so that a hook
    with error feedback (PowerSGD) is judged on such steps, not on the jump
    from the first run's magnitudes to these. Stops at the first step with
    findings, every rank together.

    Returns a :class:`CheckResult` with figures ``{"max_rel_error": float,
    "at": (step, fqn) or None}`` (the figure is reported even when no bound is
    declared, and when the check passes).
    """
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx
    bound = None if spec.lossy is None else spec.lossy.rel_error_bound
    shadow = models.model_cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    scale = rank_scale(dist.get_rank(ctx.group))
    scales = ", ".join(f"{rank_scale(r):g}" for r in range(ctx.world_size)) + " on ranks 0.." + str(ctx.world_size - 1)
    worst, at = 0.0, None
    runs = [(range(steps), models.loss_fn, ""), (range(steps, steps + uneven_steps), _scaled(models.loss_fn, scale),
                                               f"a fresh run whose ranks' gradients differ in size as real batches "
                                               f"can: each rank's loss times {scales}")]
    for numbers, loss_fn, what in runs:
        if not numbers:
            continue
        ctx.phase("building the hooked model" + (f" ({what})" if what else ""))
        hooked = models.build(hooked=True)
        optim = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
        for step in numbers:
            ctx.phase(f"step {step}: local gradients of a plain copy (the exact mean's inputs)"
                      + (f", this rank's loss times {scale:g}" if what else ""))
            _local_grads(ctx, shadow, models.full_params(hooked.model), models.inputs, loss_fn)
            exact = exact_mean(ctx, shadow)
            broken = hooked_step(hooked.recorder, train_step, ctx, "hooked", step, hooked.model, optim,
                                 models.inputs, loss_fn)
            if broken:
                return CheckResult(findings=broken, figures={"max_rel_error": worst, "at": at})
            ctx.phase(f"step {step}: full gradients of the hooked model")
            found, worst, at = _error_findings(ctx, models.full_grads(hooked.model), exact, step, bound, worst, at)
            if what:
                found = [dataclasses.replace(f, message=f"{f.message}, in {what}") for f in found]
            findings = hooked.recorder.findings(step) + found
            if ctx.any_rank(bool(findings)):
                return CheckResult(findings=findings, figures={"max_rel_error": worst, "at": at})
            ctx.phase(f"step {step}: optimizer step")
            optim.step()
    return CheckResult(findings=[], figures={"max_rel_error": worst, "at": at})


def _global_loss(ctx: CheckContext, models: ApiModels, model: nn.Module) -> float:
    """The loss over every rank's inputs (mean of the ranks' local losses, in float64)."""
    with torch.no_grad():
        local = sum(float(models.loss_fn(m, models.forward(model)(*m))) for m in models.inputs)
    t = torch.tensor([local], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return float(t.item()) / ctx.world_size


@shared_check("lossy_loss")
def lossy_loss(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, lr: float = 0.01,
               **variant: object) -> CheckResult:
    """After ``loss_steps`` SGD steps, ``|loss_hook - loss_exact| <= loss_margin * |loss_exact|``.

    ``loss_exact`` is the same model trained under the API with no hook, in full
    precision (``build(hooked=False, full_precision=True)``). Returns a
    :class:`CheckResult` with figures ``{"loss_hook", "loss_exact", "rel_diff"}``
    (floats; the finding, if any, on rank 0 only: the losses are global).
    """
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx
    contract = spec.lossy
    steps = contract.loss_steps
    loss_fn = models.loss_fn
    ctx.phase("building the no-hook model")
    ref = models.build(hooked=False, full_precision=True).model
    ctx.phase("building the hooked model")
    hooked = models.build(hooked=True)
    opt_ref = sgd(ref.parameters(), lr=lr, momentum=MOMENTUM)
    opt_hooked = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
    for step in range(steps):
        with cost.measured("native", step, ctx.device):
            train_step(ctx, "no-hook", step, ref, opt_ref, models.inputs, loss_fn)
        with cost.measured("hooked", step, ctx.device):
            broken = hooked_step(hooked.recorder, train_step, ctx, "hooked", step, hooked.model, opt_hooked,
                                 models.inputs, loss_fn)
        if broken:
            return CheckResult(findings=broken,
                               figures={"loss_hook": math.nan, "loss_exact": math.nan, "rel_diff": math.inf})
        opt_ref.step()
        opt_hooked.step()
    ctx.phase(f"evaluating the loss after {steps} steps")
    loss_exact = _global_loss(ctx, models, ref)
    loss_hook = _global_loss(ctx, models, hooked.model)
    if not math.isfinite(loss_hook):
        rel = math.inf
    elif loss_exact == 0.0:
        rel = 0.0 if loss_hook == 0.0 else math.inf
    else:
        rel = abs(loss_hook - loss_exact) / abs(loss_exact)
    findings = []
    if contract.loss_margin is not None and not rel <= contract.loss_margin:
        findings.append(Finding(ctx.rank, f"after {steps} steps the training loss is {loss_hook!r} with the hook and "
                                          f"{loss_exact!r} without: relative difference {rel:.3e} exceeds the "
                                          f"declared loss_margin {contract.loss_margin:.3e}"))
    return CheckResult(findings=findings if ctx.rank == 0 else [],
                       figures={"loss_hook": loss_hook, "loss_exact": loss_exact, "rel_diff": rel})


@shared_check("lossy_determinism")
def lossy_determinism(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int = 4,
                      lr: float = 0.01, **variant: object) -> List[Finding]:
    """Two trainings from the same seed (fresh model and hook state each) give bitwise identical gradients
    (each rank's own gradient or local shard, every step)."""
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx
    runs = []
    for run in range(2):
        ctx.phase(f"building the hooked model (run {run + 1} of 2)")
        hooked = models.build(hooked=True)
        optim = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
        per_step = []
        for step in range(steps):
            broken = hooked_step(hooked.recorder, train_step, ctx, f"hooked (run {run + 1})", step,
                                 hooked.model, optim, models.inputs, models.loss_fn)
            if broken:
                return broken
            grads = models.local_grads(hooked.model)
            per_step.append({k: (None if g is None else g.clone()) for k, g in grads.items()})
            optim.step()
        runs.append(per_step)
    for step, (first, second) in enumerate(zip(*runs)):
        findings = compare_named("gradient of the second run", second, first, rank=ctx.rank, step=step,
                                 reference="the first run from the same seed (the contract declares "
                                           "deterministic=True)")
        if findings:
            return findings
    return []
