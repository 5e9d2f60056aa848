"""Chosen gradients through the probe model, on the ranks: the hard-input check of every hook API.

``gradient_probe`` (``models/probe.py``) turns its inputs into its local
gradients bit for bit, so a hook can be fed any gradients: values near the
reduce dtype's overflow, subnormals, ``-0.0``, NaN on one rank, ``+Inf``
against ``-Inf``. :func:`hard_inputs` is every API's ``<api>.hard_inputs``
rank check: it builds the API's reference probe and hooked probe as a
:class:`~conformance.ranks.checks.lockstep.Lockstep` plan (the local gradients
only, no optimizer step: only the reduction matters) and hands it to
:func:`run_examples`.

One case is several dispatches: the named examples first, then hypothesis's
examples one at a time while it searches and shrinks. The probes of a case
stay built on the rank between its dispatches (:data:`_RUNS`), so each
further example costs one forward/backward per model, not a rebuild.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Tuple

import torch

from conformance.protocol import Finding
from conformance.ranks.checks.common import shared_check
from conformance.ranks.checks.lockstep import Lockstep, LockstepRun
from conformance.ranks.checks.models import MakeModels
from conformance.shared.standalone_inputs import placed_tensor
from conformance.catalogue import HARD_INPUTS

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

#: ``(label, grads)``: ``grads[rank][i]`` is the gradient of probe parameter ``i`` on ``rank``
#: (float32, CPU), in the order of the probe's ``input_shapes()``; for a probe of production size
#: (``large_probe``), its description instead (a dict, :func:`~conformance.shared.standalone_inputs.placed_tensor`),
#: built on the rank: tens of MiB a rank never travel through the pool's pipes.
Example = Tuple[str, Sequence[Sequence[torch.Tensor]]]

#: The lock-step run of the case that ran last on this rank, by case id.
_RUNS: Dict[str, LockstepRun] = {}


def run_examples(ctx: CheckContext, case_id: str, examples: Sequence[Example], fresh: bool,
                 make_plan: Callable[[Callable[[int], Any], Callable[[int], str]], Lockstep],
                 lr: float = HARD_INPUTS["lr"]) -> List[Finding]:
    """Feed ``examples`` through the hooked and the reference probe, one step each; findings of the first
    example that differs (every rank stops there together).

    Args:
        case_id: the case; a dispatch of the same case reuses its probes.
        examples: ``(label, grads)`` pairs, see :data:`Example`.
        fresh: build new probes (the first dispatch of a case); every rank gets
            the same value, so the collective builds match up.
        make_plan: ``make_plan(inputs, label)`` builds both probes and returns
            their plan; ``inputs(step)`` gives this rank's gradients of a step
            and ``label(step)`` its name, for messages.
    """
    run = None if fresh else _RUNS.get(case_id)
    if run is None:  # also after a pool restart, which forgets every run
        _RUNS.clear()
        current: Dict[str, Any] = {"examples": [], "first": 0}

        def inputs(step: int) -> Tuple[torch.Tensor, ...]:
            _, grads = current["examples"][step - current["first"]]
            return tuple(placed_tensor(g, ctx.device) if isinstance(g, dict) else g.to(ctx.device)
                         for g in grads[ctx.rank])

        def label(step: int) -> str:
            return f"the {current['examples'][step - current['first']][0]!r} inputs"

        run = LockstepRun(make_plan(inputs, label), lr)
        run.current = current  # type: ignore[attr-defined]
        _RUNS[case_id] = run
    run.current.update(examples=list(examples), first=run.step)  # type: ignore[attr-defined]
    return run.run(ctx, len(examples))


@shared_check("hard_inputs")
def hard_inputs(ctx: CheckContext, spec: HookSpec, make: MakeModels, *, examples: Sequence[Example], case_id: str,
                fresh: bool = True, model: str = HARD_INPUTS["model"], **variant: object) -> List[Finding]:
    """Chosen gradients through the API's probe (:func:`run_examples`), bitwise against its reference probe:
    every rank's local gradient (together, every element), one example per step, no optimizer step.

    Raises:
        ValueError: the case's variant runs several backward passes per step (DDP's ``no_sync``).
    """
    def make_plan(inputs: Callable[[int], Any], label: Callable[[int], str]) -> Lockstep:
        models = make(ctx, spec, model=model, **variant)
        if models.micro_steps != 1:
            case = ", ".join(f"{k}={v}" for k, v in variant.items())
            raise ValueError(f"hard inputs feed one backward per step; {case} accumulates {models.micro_steps}")
        plan = Lockstep.of(models, models.build(hooked=False), models.build(hooked=True),
                           inputs=lambda step: [inputs(step)], label=label)
        return dataclasses.replace(plan, grads=plan.grads[:1], params=None)

    return run_examples(ctx, case_id, examples, fresh, make_plan)
