"""``clip_grad_norm_`` with the hook installed: the clip check of every API, written once.

PyTorch's ``test_fsdp_clip_grad_norm.py`` clips both models (norm types 2 and
inf) after every backward and compares the total norms and the clipped
gradients; :func:`clip_grad_norm` does that in lock step for any API, with the
API's own ``clip_grad_norm_`` (:meth:`~conformance.ranks.checks.models.ApiModels.clip`:
FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``, else
``torch.nn.utils.clip_grad_norm_``, an FSDP2 ``DTensor`` norm as its
``full_tensor()``). Where the API's clip has a rule for a rank with no
gradients (FSDP1, its ``test_no_gradients``), a last forward with no backward
must give the same total norm and warnings with the hook as without.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.protocol import Finding
from conformance.ranks.checks.common import compare_named, reference_result, sgd, shared_check, train_alone, train_step
from conformance.catalogue import CLIP_GRAD_NORM, MOMENTUM
from conformance.ranks.checks.lockstep import Lockstep, lockstep
from conformance.ranks.checks.models import MakeModels

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

#: ``max_norm`` of the clip_grad_norm_ cases (:data:`conformance.catalogue.CLIP_MAX_NORM`, which the
#: reproducers read too): small enough that every reference model's gradients are scaled down (so the clipped
#: gradients, not only the norm, carry the result).
CLIP_MAX_NORM = CLIP_GRAD_NORM["clip_max_norm"]
#: The norm types of the clip_grad_norm_ cases (PyTorch's test_fsdp_clip_grad_norm.py uses 2 and inf).
CLIP_NORM_TYPES = (2.0, float("inf"))


def clipping(train: Callable[..., None], clip: Callable[[nn.Module], torch.Tensor], norm_type: float,
             norms: Dict[int, torch.Tensor]) -> Callable[..., None]:
    """The training step ``train`` followed by ``clip(model)``, announced as a phase; the total norm
    each model's ``clip`` returns is kept in ``norms[id(model)]`` (flattened, detached)."""
    def train_and_clip(ctx: CheckContext, label: str, step: int, model: nn.Module, optim: torch.optim.Optimizer,
                       inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Callable[..., torch.Tensor],
                       **sync: Callable[[nn.Module], ContextManager[Any]]) -> None:
        train(ctx, label, step, model, optim, inputs, loss_fn, **sync)
        ctx.phase(f"step {step}: clip_grad_norm_(max_norm={CLIP_MAX_NORM}, norm_type={norm_type}) of the "
                  f"{label} model")
        norms[id(model)] = clip(model).detach().reshape(-1)

    return train_and_clip


def clipped(plan: Lockstep, clip: Callable[[nn.Module], torch.Tensor], norm_type: float) -> Lockstep:
    """``plan`` with ``clip(model)`` (the API's ``clip_grad_norm_``) after every backward of both models.

    The total norm each returns is compared bitwise first (the view ``"total gradient norm"``),
    then the clipped gradients as ``plan`` compares them. ``clip`` returns the total norm as a
    plain tensor.
    """
    norms: Dict[int, torch.Tensor] = {}

    def total_norm(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return {f"total norm (norm_type={norm_type})": norms.get(id(model))}

    return dataclasses.replace(
        plan, train=clipping(plan.train, clip, norm_type, norms), grads=[("total gradient norm", total_norm, "")] + [
            (f"clipped {what}", named, phase) for what, named, phase in plan.grads],
        label=lambda step: f"clip_grad_norm_ norm_type={norm_type}")


def clip_without_backward(ctx: CheckContext, model: nn.Module, label: str, inputs: Tuple[torch.Tensor, ...],
                          clip: Callable[[nn.Module], torch.Tensor]) -> Tuple[torch.Tensor, List[str]]:
    """``zero_grad(set_to_none=True)``, one forward of ``model`` on ``inputs`` with no backward, then
    ``clip(model)``: the total norm and the warnings ``clip`` gave (PyTorch's ``test_no_gradients`` in
    test_fsdp_clip_grad_norm.py: FSDP's ``clip_grad_norm_`` returns a float32 zero and warns that the rank
    has no gradients)."""
    ctx.phase(f"after training: a forward of the {label} model with no backward, then clip_grad_norm_")
    model.zero_grad(set_to_none=True)
    model(*inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = clip(model).detach().reshape(-1)
    return norm, sorted({str(w.message) for w in caught})


def _without_backward_findings(ctx: CheckContext, plan: Lockstep, inputs: Tuple[torch.Tensor, ...],
                               clip: Callable[[nn.Module], torch.Tensor], norm_type: float) -> List[Finding]:
    """Both models of ``plan`` through :func:`clip_without_backward`: the total norms bitwise (dtype too), and
    the same warnings, with the hook registered as without it."""
    ref_norm, ref_warned = clip_without_backward(ctx, plan.ref.model, "reference", inputs, clip)
    norm, warned = clip_without_backward(ctx, plan.hooked.model, "hooked", inputs, clip)
    where = f"{plan.models.reference} (a forward with no backward, then clip_grad_norm_ norm_type={norm_type})"
    findings = compare_named("total gradient norm", {"total norm": norm}, {"total norm": ref_norm}, rank=ctx.rank,
                             step=None, reference=where)
    if warned != ref_warned:
        findings.append(Finding(ctx.rank, f"clip_grad_norm_ warned {warned or 'nothing'} with the hook, but "
                                          f"{ref_warned or 'nothing'} on {where}"))
    return findings


@shared_check("clip_grad_norm")
def clip_grad_norm(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str,
                   steps: int = CLIP_GRAD_NORM["steps"], lr: float = CLIP_GRAD_NORM["lr"], reference_only: bool = False,
                   **variant: object) -> List[Finding]:
    """The API's ``clip_grad_norm_`` with the hook installed, for norm types 2 and inf (:data:`CLIP_NORM_TYPES`):
    per norm type, a fresh pair trained in lock step with ``clip_grad_norm_(CLIP_MAX_NORM, norm_type)`` after
    every backward (:func:`clipped`): the total norm and the clipped gradients bitwise equal to the
    reference's, the parameters after each step too; the findings of the first norm type that differs,
    every rank stopping together.

    Where the API's clip has a rule for a rank with no gradients (``clips_without_backward``), a last forward
    with no backward on both models must then give the same total norm and warnings
    (:func:`clip_without_backward`). ``reference_only``: the reference alone, trained and clipped the same
    way, with no hooked model built (the runner's replay); returns no findings, and the digest of the trained
    references (:func:`~conformance.ranks.checks.common.reference_result`).
    """
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx
    trained = []  # reference_only: the reference of each norm type
    for norm_type in CLIP_NORM_TYPES:
        clip_one = lambda m, t=norm_type: models.clip(m, CLIP_MAX_NORM, t)  # noqa: E731
        if reference_only:
            trained.append(models.build(hooked=False).model)
            train_alone(ctx, trained[-1], sgd(trained[-1].parameters(), lr=lr, momentum=MOMENTUM), models.inputs,
                        models.loss_fn, steps, train=clipping(train_step, clip_one, norm_type, {}))
            continue
        plan = clipped(Lockstep.of(models, models.build(hooked=False), models.build(hooked=True)), clip_one,
                       norm_type)
        findings = lockstep(ctx, plan, steps=steps, lr=lr)
        if not ctx.any_rank(bool(findings)) and models.clips_without_backward:
            findings = _without_backward_findings(ctx, plan, models.inputs[-1], clip_one, norm_type)
        if ctx.any_rank(bool(findings)):
            return findings
    return reference_result(*trained) if reference_only else []
