"""The exact checks of every hook API, written once over :class:`~conformance.ranks.checks.models.ApiModels`.

Each takes ``make``, the API's models class, and the case's parameters; the
registry binds it per API as ``<api>.<check>`` (:data:`conformance.ranks.checks.common.SHARED_CHECKS`):

* :func:`averaging`: analytic ``Linear(1, world_size)``, input = rank; every
  gradient element must equal ``mean(0..world_size-1)`` exactly (or, where the
  API's reference for the claim computes another value, the reference's), as
  PyTorch's ``test_default_communication_hook_behavior``;
* :func:`parity`: gradients and parameters bitwise equal to the reference after
  every step (:func:`~conformance.ranks.checks.lockstep.lockstep`);
* :func:`rank_grads`: the hooked model's gradients per step, for the
  controller's cross-rank comparison (rank consistency);
* :func:`second_model`: parity of a second, different model wrapped and hooked in the same process after a
  first one trained (state a hook keeps outside its state object must not outlive its model).

The clip check is :mod:`conformance.ranks.checks.clip`'s, the hard inputs
:mod:`conformance.ranks.checks.probe`'s, the lossy contracts
:mod:`conformance.ranks.checks.lossy`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

from conformance.protocol import CheckResult, Finding
from conformance.ranks.checks.common import (averaging_findings, grads_per_step, hooked_step, sgd, shared_check,
                                             train_alone, train_step)
from conformance.catalogue import AVERAGING, MOMENTUM, PARITY, SECOND_MODEL
from conformance.ranks.checks.lockstep import Lockstep, lockstep
from conformance.ranks.checks.models import MakeModels
from conformance.ranks.diagnosis import diagnose

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec


@shared_check("averaging")
def averaging(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str = AVERAGING["model"],
              steps: int = AVERAGING["steps"], lr: float = AVERAGING["lr"], **variant: object) -> List[Finding]:
    """Seed ``test_default_communication_hook_behavior``: every gradient equals mean(0..world_size-1), each step.

    Where the API's reference for the hook's claim computes another average
    (:meth:`~conformance.ranks.checks.models.ApiModels.reference_average`: DDP's
    documented reduced-precision equivalent), the reference is trained beside
    it and its gradients are the expected values. A hook whose result equals
    each rank's own local gradient on every rank is reported as such
    (:func:`~conformance.ranks.checks.common.averaging_findings`); the diagnosis
    (:func:`conformance.ranks.diagnosis.diagnose`) says whether it communicated.
    """
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx
    hooked = models.build(hooked=True)
    recorder = hooked.recorder
    optim = sgd(hooked.model.parameters(), lr=lr, momentum=AVERAGING["momentum"])
    what = models.reference_average(hooked.model)
    ref = ref_optim = None
    if what is not None:
        ref = models.build(hooked=False).model
        ref_optim = sgd(ref.parameters(), lr=lr, momentum=AVERAGING["momentum"])
    for step in range(steps):
        broken = hooked_step(recorder, train_step, ctx, "hooked", step, hooked.model, optim, models.inputs,
                             models.loss_fn)
        if broken:
            return broken
        expected = None
        if ref is not None:
            train_step(ctx, "reference", step, ref, ref_optim, models.inputs, models.loss_fn)
            expected = models.local_grads(ref)
        findings = averaging_findings(ctx, models.local_grads(hooked.model), step, expected=expected,
                                      what=what or "", skip_missing=models.empty_shards)
        if ctx.any_rank(bool(findings)):  # a "local_gradient" finding is on every rank
            ctx.phase(f"step {step}: diagnosing the difference")
            return findings + diagnose(ctx, models.arithmetic, recorder.log, step)
        optim.step()
        if ref_optim is not None:
            ref_optim.step()
    return []


@shared_check("parity")
def parity(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int = PARITY["steps"],
           lr: float = PARITY["lr"], reference_only: bool = False, **variant: object) -> Any:
    """Gradients and parameters bitwise equal to the reference (the native path for the hook's claim) after
    every step, per parameter FQN; ``steps`` of them, or the model's ``max_steps`` where fewer (a model of
    production-sized buffers). ``reference_only``: train the reference alone, with no hooked model built
    (the runner's replay, :data:`conformance.controller.replays.REPLAYS_REFERENCE`); returns no findings, and
    the digest of the trained reference (:func:`~conformance.ranks.checks.common.reference_result`)."""
    models = make(ctx, spec, model=model, **variant)
    steps = min(steps, models.model_cls.max_steps or steps)
    ref = models.build(hooked=False)
    if reference_only:
        optim = sgd(ref.model.parameters(), lr=lr, momentum=MOMENTUM)
        return train_alone(models.ctx, ref.model, optim, models.inputs, models.loss_fn, steps,
                           train=models.train_step, no_sync=models.no_sync, check=models.check_reference)
    return lockstep(models.ctx, Lockstep.of(models, ref, models.build(hooked=True)), steps=steps, lr=lr)


@shared_check("second_model")
def second_model(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int = SECOND_MODEL["steps"],
                 lr: float = SECOND_MODEL["lr"], second: str = SECOND_MODEL["second"], reference_only: bool = False,
                 **variant: object) -> Any:
    """Parity of a second model wrapped and hooked in the same process, after a first one trained with the hook.

    A job builds several wrapped models in one process: a resumed run re-wraps its model, a fine-tune follows a
    pretraining, an evaluation or teacher model sits beside the student. PyTorch's own averaging keeps nothing
    across them (each ``DistributedDataParallel`` has its own ``Reducer``, each FSDP module its own flat
    parameters and handles), and a fresh hook state (``HookSpec.state``) is built for each. A hook that keeps
    state of its own outside that state object (a module-level cache keyed by bucket index or size, a global
    step counter, a process group or divisor saved on first use) carries the first model's into the second.

    The case's ``model`` is built hooked and trained ``steps`` steps alone (SGD, momentum 0.9); it is then
    dropped, and ``second`` (another :data:`conformance.models.MODELS` entry, whose buckets, FSDP units and flat
    parameters differ) is built twice, reference and hooked, and trained in lock step for ``steps`` steps
    (:func:`~conformance.ranks.checks.lockstep.lockstep`): gradients and parameters bitwise equal to the
    reference every step. ``reference_only``: train ``second``'s reference alone (the runner's replay) and return
    its digest (:func:`~conformance.ranks.checks.common.reference_result`).

    Returns:
        this rank's findings (empty when the hook conforms), or the reference's digest.
    """
    if not reference_only:
        first = make(ctx, spec, model=model, **variant)
        hooked = first.build(hooked=True)
        optim = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
        for step in range(min(steps, first.model_cls.max_steps or steps)):
            broken = hooked_step(hooked.recorder, first.train_step, first.ctx, f"first ({model}) hooked", step,
                                 hooked.model, optim, first.inputs, first.loss_fn, no_sync=first.no_sync)
            if broken:
                return broken
            optim.step()
        del hooked, optim
    models = make(ctx, spec, model=second, **variant)
    steps = min(steps, models.model_cls.max_steps or steps)
    ref = models.build(hooked=False)
    if reference_only:
        optim = sgd(ref.model.parameters(), lr=lr, momentum=MOMENTUM)
        return train_alone(models.ctx, ref.model, optim, models.inputs, models.loss_fn, steps,
                           train=models.train_step, no_sync=models.no_sync, check=models.check_reference)
    after = f"a second model ({second}), wrapped after a hooked {model} trained {steps} steps in this process"
    return lockstep(models.ctx, Lockstep.of(models, ref, models.build(hooked=True), label=lambda step: after,
                                            sides=(f"second ({second}) reference", f"second ({second}) hooked")),
                    steps=steps, lr=lr)


@shared_check("rank_grads")
def rank_grads(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int = 3, lr: float = 0.01,
               **variant: object) -> CheckResult:
    """The hooked model's gradients after each step, for a cross-rank comparison (:func:`grads_per_step`); its
    findings are what the recorder reported when the hook broke the API's contract, which stopped the training,
    or the diagnosis (:func:`conformance.ranks.diagnosis.diagnose`) of the first step after which the ranks'
    gradients differ."""
    models = make(ctx, spec, model=model, **variant)
    hooked = models.build(hooked=True)
    optim = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
    return grads_per_step(models.ctx, hooked.model, optim, models.inputs, models.loss_fn, steps,
                          named=models.local_grads, recorder=hooked.recorder,
                          diagnose=lambda step: diagnose(models.ctx, models.arithmetic, hooked.recorder.log, step))
