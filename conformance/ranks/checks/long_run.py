"""The long run: hundreds to thousands of training steps, every one compared bit for bit, at a small model's cost.

Hooks change behaviour after many steps: PowerSGD's warm-up (``start_powerSGD_iter``, 1,000 by default),
post-local-SGD's ``start_localSGD_iter``, communication skipping that reuses the last reduced gradient,
periodic consistency checks that write into the buffer, counters and buffer pools that wrap. A check of a few
steps never meets them. :func:`long_run` trains the reference model and the hooked one side by side for
``steps`` steps in two passes:

1. **Unrecorded.** The hook's recorder keeps no copies (:attr:`~conformance.ranks.checks.models.Recorder.recording`
   off; its contract findings stay), and each rank compares its own gradients (local shards where sharded) and
   parameters with the reference's after every step, locally: both models live on the rank, so no collective
   is needed per step. The ranks agree, with one small all-reduce at a few check-in steps (:func:`check_in`:
   0, 1, 3, 7, ... and every :data:`CHECK_IN_EVERY`), whether any of them has seen a difference, and stop
   together; then on the first step that differed on any rank.
2. **Replayed.** Where a step differed, fresh models and a fresh hook state train again, deterministically,
   up to that step with the recorder on (:func:`~conformance.ranks.checks.lockstep.lockstep`): its findings
   carry the diagnosis, and name the step (``the long run first differs at step 200 of 2000``), which is where
   a reproducer trains to.

The objective is a regression onto random targets with inputs that change every step
(:func:`~conformance.shared.standalone_inputs.regression_inputs`, ``regression_loss``): a model trained on its
own ``output.sum()`` overflows within ten steps, after which NaN equals NaN on both sides and nothing is checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch.distributed as dist
import torch

from conformance.protocol import CheckResult, Finding, FindingKind
from conformance.ranks import cost
from conformance.ranks.checks.common import compare_named, hooked_step, reference_result, sgd, shared_check
from conformance.catalogue import LONG_RUN, MOMENTUM
from conformance.ranks.checks.lockstep import Lockstep, lockstep
from conformance.ranks.checks.models import ApiModels, Built, MakeModels
# The objective is the reproducers' (torch only), which copy it into every file.
from conformance.shared.standalone_inputs import regression_inputs, regression_loss

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

__all__ = ["CHECK_IN_EVERY", "check_in", "long_run"]

#: After the first steps' check-ins (0, 1, 3, 7, ...), the ranks agree whether to stop every this many steps.
CHECK_IN_EVERY = 64


def check_in(step: int, steps: int) -> bool:
    """Whether the ranks agree after ``step`` (0-based) of ``steps`` whether any has seen a difference: after
    steps 0, 1, 3, 7, ... (``step + 1`` a power of two) up to :data:`CHECK_IN_EVERY`, then every
    :data:`CHECK_IN_EVERY` steps, and after the last. A hook that fails early stops early; one that passes
    costs a dozen small all-reduces over thousands of steps."""
    n = step + 1
    return n == steps or n % CHECK_IN_EVERY == 0 or (n < CHECK_IN_EVERY and n & (n - 1) == 0)


def _agree_first(ctx: CheckContext, first: Optional[int], steps: int) -> Optional[int]:
    """The first step that differed on any rank of ``ctx.group`` (an all-reduce with MIN), or ``None``."""
    t = torch.tensor([steps if first is None else first], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.group)
    value = int(t.item())
    return None if value >= steps else value


class _OnePhasePerStep:
    """``ctx`` for the training inside one unrecorded step: its phases are kept, not sent (the step's own phase
    was; thousands of steps would otherwise send several messages each to the controller)."""

    def __init__(self, ctx: CheckContext):
        self._ctx = ctx

    def phase(self, text: str) -> None:
        self._ctx.current_phase = text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def _unrecorded(ctx: CheckContext, models: ApiModels, ref: Built, hooked: Built, inputs: Callable[[int], Any],
                steps: int, lr: float) -> Tuple[Optional[int], List[Finding]]:
    """Pass 1: ``(first step that differed on any rank, or None; this rank's findings of its own first
    differing step)``."""
    quiet = _OnePhasePerStep(ctx)
    recorder = hooked.recorder
    assert recorder is not None, "the hooked model has a recorder"
    recorder.recording = False
    opt_ref = sgd(ref.model.parameters(), lr=lr, momentum=MOMENTUM)
    opt_hooked = sgd(hooked.model.parameters(), lr=lr, momentum=MOMENTUM)
    # The first gradient view and the parameter view are this rank's own tensors (local shards where sharded):
    # no collective (:class:`~conformance.ranks.checks.models.ApiModels`).
    (grads_what, grads, _), (params_what, params, _) = models.grad_views[0], models.param_view
    first: Optional[int] = None
    mine: List[Finding] = []
    for step in range(steps):
        # Every rank trains every step, whatever it found: a rank that stopped while its peers went on would
        # leave them waiting in the models' collectives. Only the comparisons stop at a rank's first difference.
        ctx.phase(f"step {step} of {steps}: training both models (unrecorded)")
        batch = inputs(step)
        with cost.measured("native", step, ctx.device, models.reference_dtypes):
            models.train_step(quiet, "reference", step, ref.model, opt_ref, batch, regression_loss,
                              no_sync=models.no_sync)
        with cost.measured("hooked", step, ctx.device):
            broken = hooked_step(recorder, models.train_step, quiet, "hooked", step, hooked.model, opt_hooked,
                                 batch, regression_loss, no_sync=models.no_sync)
        if first is None:
            found = list(broken or []) + recorder.findings(step)
            if not broken:
                found += compare_named(grads_what, grads(hooked.model), grads(ref.model), rank=ctx.rank, step=step,
                                       reference=models.reference, reduce_dtype=models.reduce_dtype)
            if found:
                first, mine = step, found
        opt_ref.step()
        opt_hooked.step()
        if first is None:
            found = compare_named(params_what, params(hooked.model), params(ref.model), rank=ctx.rank, step=step,
                                  reference=models.reference)
            if found:
                first, mine = step, found
        if check_in(step, steps) and ctx.any_rank(first is not None):
            return _agree_first(ctx, first, steps), mine
    return None, []


@shared_check("long_run")
def long_run(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, model: str, steps: int, lr: float = LONG_RUN["lr"],
             reference_only: bool = False, **variant: object) -> Any:
    """``steps`` training steps of the reference and the hooked model, compared bit for bit after every one
    (gradients, local shards where sharded, and parameters), unrecorded; a difference is replayed with the
    recorder on up to its step, for the findings and the diagnosis (module docstring).

    ``reference_only``: train the reference alone for ``steps`` steps (the runner's replay,
    :data:`conformance.controller.replays.REPLAYS_REFERENCE`); returns no findings, and the digest of the
    trained reference (:func:`~conformance.ranks.checks.common.reference_result`).

    Returns:
        a :class:`~conformance.protocol.CheckResult` of this rank's findings (none for ``reference_only``), empty
        when every step matched: where one differed, a first finding (rank 0)
        that says at which step of how many, then the replay's findings with their diagnosis (or, where the
        replay matched, the unrecorded pass's own findings and why there is no diagnosis).
    """
    models = make(ctx, spec, model=model, **variant)
    ctx = models.ctx

    def inputs(step: int) -> Any:
        return regression_inputs(models.model_cls, ctx.rank, ctx.world_size, step, models.micro_steps, ctx.device)

    ref = models.build(hooked=False)
    if reference_only:
        optim = sgd(ref.model.parameters(), lr=lr, momentum=MOMENTUM)
        for step in range(steps):
            models.train_step(ctx, "reference", step, ref.model, optim, inputs(step), regression_loss,
                              no_sync=models.no_sync)
            optim.step()
        return reference_result(ref.model)
    hooked = models.build(hooked=True)
    first, mine = _unrecorded(ctx, models, ref, hooked, inputs, steps, lr)
    if first is None:
        why = hooked.recorder.unused() if hooked.recorder is not None else None
        return CheckResult(findings=[Finding(ctx.rank, why, kind=FindingKind.HOOK_NOT_CALLED)] if why else [])
    del ref, hooked
    ctx.phase(f"the long run first differs at step {first} of {steps}: replaying steps 0 to {first} with the "
              "recorder on")
    plan = Lockstep.of(models, models.build(hooked=False), models.build(hooked=True), inputs=inputs,
                       loss_fn=regression_loss)
    replayed = lockstep(ctx, plan, steps=first + 1, lr=lr)
    head = (f"the long run first differs at step {first} of {steps} (both models trained unrecorded, compared on "
            f"every rank after every step; then replayed from step 0 with the recorder on")
    if any(f.kind != FindingKind.HOOK_NOT_CALLED for f in replayed):
        note = head + f", which differs at step {min(f.step for f in replayed if f.step is not None)})"
        return CheckResult(findings=([Finding(0, note, step=first)] if ctx.rank == 0 else []) + replayed)
    note = head + (", which matched: the hook's results depend on more than its inputs and its own state "
                   "(timing, randomness, state kept outside its state object), so there is no diagnosis; the "
                   "unrecorded pass's findings follow)")
    return CheckResult(findings=([Finding(0, note, step=first)] if ctx.rank == 0 else []) + mine)
