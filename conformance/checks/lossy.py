"""Rank-side checks of a :class:`~conformance.spec.LossyContract`: what a lossy hook promises instead of exactness.

A lossy hook (PowerSGD, 8-bit quantization) is not held to bitwise parity. It
is compared with the exact mean over ranks of the same local gradients,
computed in float64, and held to what its contract declares:

* ``ddp.lossy_error``: per step and parameter, the relative error against the
  exact mean (the observed maximum is returned as a figure), the declared
  ``rel_error_bound``, and no NaN/Inf where the exact mean has none;
* ``ddp.lossy_loss``: the training loss after ``loss_steps`` steps is within
  the declared ``loss_margin`` of the no-hook run;
* ``ddp.lossy_determinism``: two runs from the same seed give bitwise
  identical gradients.

The contract and the arithmetic here (:func:`relative_error`,
:func:`exact_mean`) are API-neutral; the checks drive DDP models today
(``conformance.adapters.ddp``), the only API whose specs declare contracts yet.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.checks import rank_check
from conformance.checks.common import compare_named
from conformance.adapters.ddp import _grads, build_ddp, build_hooked, micro_inputs, train_step
from conformance.adapters.ddp_future import hooked_step
from conformance.protocol import CheckResult, Finding


def _local_grads(shadow: nn.Module, source: nn.Module, inputs: Sequence[Tuple[torch.Tensor, ...]],
                 loss_fn: Any) -> None:
    """Leave this rank's unreduced gradients at ``source``'s parameters in ``shadow`` (a plain copy, no DDP)."""
    with torch.no_grad():
        for p_s, p in zip(shadow.parameters(), source.parameters()):
            p_s.copy_(p)
    for p in shadow.parameters():
        p.grad = None
    for micro in inputs:
        loss_fn(micro, shadow(*micro)).backward()


def exact_mean(ctx: Any, shadow: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The mean over ranks of ``shadow``'s gradients, summed in float64 in one all-reduce.

    A gradient that is None on every rank stays None; one that is None on
    some ranks only counts as zeros there.
    """
    named = list(shadow.named_parameters())
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


@rank_check("ddp.lossy_error")
def lossy_error(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 6, lr: float = 1e-3) -> Dict[str, Any]:
    """Per step and parameter: relative error vs the exact mean, the declared bound, no NaN/Inf introduced.

    Returns ``{"findings": [...], "max_rel_error": float, "at": (step, fqn)}``
    (the figure is reported even when no bound is declared).
    """
    from conformance.models import get_model

    contract = spec.lossy
    bound = None if contract is None else contract.rel_error_bound
    model_cls = get_model(model)
    ctx.phase("building the hooked DDP model")
    hooked, recorder = build_hooked(spec, model, ctx, config)
    shadow = model_cls.build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
    optim = torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9)
    inputs = micro_inputs(model_cls, ctx, config)
    worst, at = 0.0, None
    findings: List[Finding] = []
    for step in range(steps):
        ctx.phase(f"step {step}: local gradients of a plain copy (the exact mean's inputs)")
        _local_grads(shadow, hooked.module, inputs, model_cls.loss)
        exact = exact_mean(ctx, shadow)
        broken = hooked_step(ctx, recorder, step,
                             lambda: train_step(ctx, "hooked", step, hooked, optim, inputs, model_cls.loss))
        if broken:
            return CheckResult(findings=broken, figures={"max_rel_error": worst, "at": at})
        got = _grads(hooked)
        for fqn, e in exact.items():
            g = got.get(fqn)
            if e is None and (g is None or not bool(g.any())):
                continue  # unused everywhere: no gradient, or zeros DDP filled in
            if e is None or g is None:
                findings.append(Finding(ctx.rank, f"gradient is {'None' if g is None else 'set'} with the hook "
                                                  f"but {'None' if e is None else 'set'} without it",
                                        step=step, fqn=fqn))
                continue
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
        if ctx.any_rank(bool(findings)):
            break
        optim.step()
    return CheckResult(findings=findings, figures={"max_rel_error": worst, "at": at})


def _global_loss(ctx: Any, model: nn.Module, model_cls: Any, inputs: Sequence[Tuple[torch.Tensor, ...]]) -> float:
    """The loss over every rank's inputs (mean of the ranks' local losses, in float64)."""
    with torch.no_grad():
        local = sum(float(model_cls.loss(m, model.module(*m))) for m in inputs)
    t = torch.tensor([local], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return float(t.item()) / ctx.world_size


@rank_check("ddp.lossy_loss")
def lossy_loss(ctx: Any, spec: Any, *, config: str, model: str, lr: float = 0.01) -> Dict[str, Any]:
    """After ``loss_steps`` SGD steps, ``|loss_hook - loss_exact| <= loss_margin * |loss_exact|``.

    Returns ``{"findings", "loss_hook", "loss_exact", "rel_diff"}``.
    """
    from conformance.models import get_model

    contract = spec.lossy
    steps = contract.loss_steps
    model_cls = get_model(model)
    ctx.phase("building the no-hook DDP model")
    ref = build_ddp(model, ctx, config)
    ctx.phase("building the hooked DDP model")
    hooked, recorder = build_hooked(spec, model, ctx, config)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    opt_hooked = torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9)
    inputs = micro_inputs(model_cls, ctx, config)
    for step in range(steps):
        train_step(ctx, "no-hook", step, ref, opt_ref, inputs, model_cls.loss)
        broken = hooked_step(ctx, recorder, step,
                             lambda: train_step(ctx, "hooked", step, hooked, opt_hooked, inputs, model_cls.loss))
        if broken:
            return CheckResult(findings=broken,
                               figures={"loss_hook": math.nan, "loss_exact": math.nan, "rel_diff": math.inf})
        opt_ref.step()
        opt_hooked.step()
    ctx.phase(f"evaluating the loss after {steps} steps")
    loss_exact = _global_loss(ctx, ref, model_cls, inputs)
    loss_hook = _global_loss(ctx, hooked, model_cls, inputs)
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


@rank_check("ddp.lossy_determinism")
def lossy_determinism(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 4,
                      lr: float = 0.01) -> List[Finding]:
    """Two trainings from the same seed (fresh model and hook state each) give bitwise identical gradients."""
    from conformance.models import get_model

    model_cls = get_model(model)
    inputs = micro_inputs(model_cls, ctx, config)
    runs = []
    for run in range(2):
        ctx.phase(f"building the hooked DDP model (run {run + 1} of 2)")
        hooked, recorder = build_hooked(spec, model, ctx, config)
        optim = torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9)
        per_step = []
        for step in range(steps):
            broken = hooked_step(ctx, recorder, step, lambda: train_step(
                ctx, f"hooked (run {run + 1})", step, hooked, optim, inputs, model_cls.loss))
            if broken:
                return broken
            per_step.append({k: (None if g is None else g.clone()) for k, g in _grads(hooked).items()})
            optim.step()
        runs.append(per_step)
    for step, (first, second) in enumerate(zip(*runs)):
        findings = compare_named("gradient of the second run", second, first, rank=ctx.rank, step=step,
                                  reference="the first run from the same seed (the contract declares "
                                          "deterministic=True)")
        if findings:
            return findings
    return []
