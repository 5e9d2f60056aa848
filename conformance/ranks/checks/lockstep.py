"""The one lock-step loop: a reference model and a hooked model trained side by side, compared every step.

Modelled on ``_get_grads`` in PyTorch's ``test_ddp_hooks.py``: the same model
built twice, with and without the hook, the same inputs, compared after every
backward and every optimizer step, for every API alike. A :class:`Lockstep` is
made from a case's :class:`~conformance.ranks.checks.models.ApiModels` and the
pair it built by one function, :meth:`Lockstep.of`; what differs per API
(the views, the recorder's findings, the arithmetic the diagnosis recomputes)
comes from those.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from conformance.protocol import Finding, FindingKind
from conformance.ranks import cost
from conformance.ranks.checks.common import View, compare_named, hooked_step, sgd, train_step
from conformance.catalogue import MOMENTUM
from conformance.ranks.checks.models import ApiModels, Built, Recorder
from conformance.ranks.diagnosis import diagnose

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext

__all__ = ["Lockstep", "LockstepRun", "lockstep"]


@dataclasses.dataclass
class Lockstep:
    """A reference model and a hooked model of one case, and what is compared after each step.

    Attributes:
        models: the case's models (its context, inputs' loss, reference name, arithmetic).
        ref, hooked: the pair, built alike but for the hook (``hooked.recorder`` wraps it).
        inputs: this rank's inputs of a step, as :func:`~conformance.ranks.checks.common.train_step`
            takes them (one tuple per micro-step): the same every step, or ``inputs(step)`` when callable
            (hard inputs: one example per step).
        grads: gradient views compared after each backward, in order; the ranks
            agree to stop after each view that found something.
        params: the parameter view compared after each optimizer step, or
            ``None``: no optimizer step (hard inputs, where only the reduction
            of the gradients matters).
        train: the training step of both models (:func:`train_step`, or it followed by ``clip_grad_norm_``).
        label: ``label(step)``, what the step feeds or does (hard inputs' example, the clip's norm type):
            the first part of the note on gradient findings, before the recorder's context.
        loss_fn: ``loss_fn(inputs, output)``, the loss both models train on; ``None``: the model's own
            (:attr:`~conformance.ranks.checks.models.ApiModels.loss_fn`).
        sides: what the rank's phases call the reference and the hooked model (``"step 0: forward/backward of
            the hooked model"``), so a rank that raises says which model it was training.
    """

    models: ApiModels
    ref: Built
    hooked: Built
    inputs: Any
    grads: Sequence[View]
    params: Optional[View]
    train: Callable[..., None] = train_step
    label: Optional[Callable[[int], str]] = None
    loss_fn: Optional[Callable[..., torch.Tensor]] = None
    sides: Tuple[str, str] = ("reference", "hooked")

    @classmethod
    def of(cls, models: ApiModels, ref: Built, hooked: Built, *,
           inputs: Optional[Union[Sequence[Tuple[torch.Tensor, ...]],
                                  Callable[[int], Sequence[Tuple[torch.Tensor, ...]]]]] = None,
           label: Optional[Callable[[int], str]] = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
           sides: Tuple[str, str] = ("reference", "hooked")) -> "Lockstep":
        """The plan of ``models``' pair: its gradient and parameter views, its training step, its inputs unless
        ``inputs`` is given, the model's own loss unless ``loss_fn`` is given."""
        return cls(models=models, ref=ref, hooked=hooked, inputs=models.inputs if inputs is None else inputs,
                   grads=models.grad_views, params=models.param_view, train=models.train_step, label=label,
                   loss_fn=loss_fn, sides=sides)

    @property
    def recorder(self) -> Recorder:
        assert self.hooked.recorder is not None, "the hooked model of a lock-step plan has a recorder"
        return self.hooked.recorder

    def note(self, step: int) -> str:
        """What the step's gradient findings are compared under: the label, then the recorder's context."""
        parts = [self.label(step) if self.label else "", self.recorder.context(step)]
        return "; ".join(p for p in parts if p)


class LockstepRun:
    """One lock-step training of ``plan``: its optimizers and step count, kept between calls.

    :func:`lockstep` runs one from scratch; hard inputs keep one per case on
    the rank (:mod:`conformance.ranks.checks.probe`), so each further example
    costs one forward/backward, not a rebuild. Steps are numbered from 0 across
    calls; ``plan.inputs(step)`` and ``plan.label(step)`` see that number.
    """

    def __init__(self, plan: Lockstep, lr: float):
        self.plan = plan
        self.step = 0
        self.opt_ref = sgd(plan.ref.model.parameters(), lr=lr, momentum=MOMENTUM)
        self.opt_hooked = sgd(plan.hooked.model.parameters(), lr=lr, momentum=MOMENTUM)

    def run(self, ctx: CheckContext, steps: int) -> List[Finding]:
        """Train ``steps`` more steps; stop at the first with findings, once every rank agrees."""
        recorder = self.plan.recorder
        for _ in range(steps):
            step = self.step
            ctx.report_on_error(lambda: recorder.findings_so_far(step))
            stop, findings = self._one_step(ctx, step)
            ctx.report_on_error(None)
            self.step += 1
            if stop:
                return findings
        return []

    def _one_step(self, ctx: CheckContext, step: int) -> Tuple[bool, List[Finding]]:
        """One step; ``(stop, findings)``: ``stop`` when any rank found something (the same on every rank)."""
        plan, models, recorder = self.plan, self.plan.models, self.plan.recorder
        inputs = plan.inputs(step) if callable(plan.inputs) else plan.inputs
        ref, hooked = plan.ref.model, plan.hooked.model
        loss_fn = plan.loss_fn or models.loss_fn
        with cost.measured("native", step, ctx.device, models.reference_dtypes):
            plan.train(ctx, plan.sides[0], step, ref, self.opt_ref, inputs, loss_fn, no_sync=models.no_sync)
        models.check_reference(ref, inputs, step)
        with cost.measured("hooked", step, ctx.device):
            broken = hooked_step(recorder, plan.train, ctx, plan.sides[1], step, hooked, self.opt_hooked,
                                 inputs, loss_fn, no_sync=models.no_sync)
        if broken:
            return True, broken
        findings = recorder.findings(step)
        note = plan.note(step)
        against = f"{models.reference} ({note})" if note else models.reference
        for what, named, phase in plan.grads:
            if phase:
                ctx.phase(f"step {step}: {phase}")
            findings += compare_named(what, named(hooked), named(ref), rank=ctx.rank, step=step,
                                      reference=against, reduce_dtype=models.reduce_dtype)
            if ctx.any_rank(bool(findings)):
                ctx.phase(f"step {step}: diagnosing the difference")
                return True, findings + diagnose(ctx, models.arithmetic, recorder.log, step)
        if plan.params is None:
            return False, []
        ctx.phase(f"step {step}: optimizer step")
        self.opt_ref.step()
        self.opt_hooked.step()
        what, named, _ = plan.params
        findings = compare_named(what, named(hooked), named(ref), rank=ctx.rank, step=step,
                                 reference=models.reference)
        return ctx.any_rank(bool(findings)), findings


def lockstep(ctx: CheckContext, plan: Lockstep, *, steps: int, lr: float) -> List[Finding]:
    """Train ``plan.ref`` and ``plan.hooked`` side by side with SGD (momentum 0.9) for ``steps`` steps.

    Per step: the reference's forward/backward, the hooked model's, the hook
    recorder's findings and every gradient view compared bitwise (a difference
    is diagnosed on every rank: :func:`conformance.ranks.diagnosis.diagnose`);
    then both optimizer steps and the parameters compared bitwise (unless
    ``plan.params`` is ``None``). Stops at the first step with findings, once
    every rank agrees (``ctx.any_rank``), so no rank is left waiting in a collective.

    Returns:
        this rank's findings (empty when the hook conforms); where the training matched but the API never
        called the hook, by design (:meth:`~conformance.ranks.checks.models.Recorder.unused`), one finding of
        kind ``"hook_not_called"`` saying so.
    """
    findings = LockstepRun(plan, lr).run(ctx, steps)
    why = None if findings else plan.recorder.unused()
    return [Finding(ctx.rank, why, kind=FindingKind.HOOK_NOT_CALLED)] if why else findings
