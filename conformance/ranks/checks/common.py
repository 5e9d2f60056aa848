"""What the rank checks of every API share: one training step, one lock-step loop, comparing named tensors.

``compare_named`` is the one place where "the hooked model's gradient (or
parameter) for this FQN equals the reference's bit for bit" becomes findings,
and :func:`lockstep` the one loop that trains a reference model and a hooked
model side by side and compares them after every step, for FSDP, DDP and FSDP2
alike (modelled on ``_get_grads`` in PyTorch's ``test_ddp_hooks.py``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.ranks.compare import compare_bitwise
from conformance.protocol import CheckResult, Finding

#: Prefixes FSDP (and activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")


def fqn_without_wrappers(name: str) -> str:
    """A parameter's FQN in the unwrapped model: FSDP's wrapper prefixes removed (FSDP1 and FSDP2)."""
    return _WRAPPER_PREFIXES.sub("", name)


def fqn_inside_ddp(name: str) -> str:
    """A parameter's FQN in the model DDP wraps: DDP's own leading ``module.`` removed (once)."""
    return name[len("module."):] if name.startswith("module.") else name


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of a DTensor (``to_local()``, FSDP2), else the tensor itself."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def named_grads(model: nn.Module, fqn: Callable[[str], str] = fqn_without_wrappers
                ) -> Dict[str, Optional[torch.Tensor]]:
    """``{fqn: gradient}`` of every parameter, ``None`` where it has none; an FSDP2 gradient as its local shard."""
    return {fqn(n): None if p.grad is None else local(p.grad.detach()) for n, p in model.named_parameters()}


def named_params(model: nn.Module, fqn: Callable[[str], str] = fqn_without_wrappers) -> Dict[str, torch.Tensor]:
    """``{fqn: parameter}``; an FSDP2 parameter as its local shard."""
    return {fqn(n): local(p.detach()) for n, p in model.named_parameters()}


def compare_named(what: str, actual: Dict[str, Any], expected: Dict[str, Any], *, rank: int, step: Optional[int],
                  reference: str = "the native path", reduce_dtype: Optional[torch.dtype] = None) -> List[Finding]:
    """Findings for every FQN of ``expected`` whose tensor in ``actual`` is not bitwise equal.

    Args:
        what: what the tensors are, e.g. ``"gradient"``; starts each message.
        actual: FQN -> tensor (or ``None``) of the hooked model on this rank.
        expected: FQN -> tensor (or ``None``) of the reference model on this rank.
        rank, step: where the comparison happened, for the findings (``step=None``: after training).
        reference: the reference's name in messages, e.g. ``"DDP with no hook"``.
        reduce_dtype: the hook's claimed reduce dtype, or ``None``: a mismatch then
            counts its ULPs in that dtype too (``Mismatch.max_ulp_diff_reduce``).

    A tensor present on one side and ``None`` on the other is a finding too.
    Comparison is :func:`conformance.ranks.compare.compare_bitwise` (NaN equals NaN).
    """
    findings: List[Finding] = []
    for fqn, exp in expected.items():
        act = actual.get(fqn)
        if exp is None and act is None:
            continue
        if exp is None or act is None:
            findings.append(Finding(rank, f"{what} is {'None' if act is None else 'set'} with the hook but "
                                          f"{'None' if exp is None else 'set'} on {reference}", step=step, fqn=fqn))
            continue
        mismatch = compare_bitwise(act, exp, reduce_dtype=reduce_dtype)
        if mismatch is not None:
            findings.append(Finding(rank, f"{what} differs from {reference}", step=step, fqn=fqn, mismatch=mismatch))
    return findings


def train_step(ctx: Any, label: str, step: int, model: nn.Module, optim: torch.optim.Optimizer,
               inputs: Sequence[torch.Tensor], loss_fn: Any) -> None:
    """Zero the gradients, then one forward/backward of ``model`` on ``inputs``, announced as a phase."""
    ctx.phase(f"step {step}: forward/backward of the {label} model")
    optim.zero_grad(set_to_none=True)
    loss_fn(inputs, model(*inputs)).backward()


def train_alone(ctx: Any, model: nn.Module, optim: torch.optim.Optimizer, inputs: Sequence[Any],
                loss_fn: Any, steps: int, train: Any = train_step) -> List[Any]:
    """Train the reference model alone for ``steps`` steps, comparing nothing (``reference_only=True``).

    ``train`` is the API's training step (DDP's runs ``no_sync`` micro-steps).
    The same phases as in lock-step training, so a failure here reads the same.
    Returns no findings: the controller only asks whether this raises.
    """
    for step in range(steps):
        train(ctx, "reference", step, model, optim, inputs, loss_fn)
        ctx.phase(f"step {step}: optimizer step of the reference model")
        optim.step()
    return []


#: ``(what, named tensors of a model, phase to announce first or "")``: one comparison of the loop.
View = Tuple[str, Callable[[nn.Module], Dict[str, Any]], str]


@dataclasses.dataclass
class Lockstep:
    """A reference model and a hooked model, and how one API compares them.

    Attributes:
        ref, hooked: the two models, built alike but for the hook.
        inputs: this rank's inputs, as the API's ``train`` takes them: the same
            every step, or ``inputs(step)`` when callable (hard inputs: one
            example per step).
        loss_fn: ``loss_fn(inputs, output)`` of the reference model class.
        reference: the reference's name in messages (``"DDP with no hook"``).
        grads: gradient views compared after each backward, in order; the ranks
            agree to stop after each view that found something.
        params: the parameter view compared after each optimizer step, or
            ``None``: no optimizer step (hard inputs, where only the reduction
            of the gradients matters).
        hook_findings: ``hook_findings(step)``: what the hook's recorder saw in
            the step (wrong dtype, never called, a broken contract).
        start_step: ``start_step(step)``, called before the step's backward
            passes (the recorder learns the step).
        train: the API's training step (DDP's runs ``no_sync`` micro-steps).
        guard_hooked: wraps the hooked model's step; returns findings that end
            the check when the hook broke the API's contract (DDP's future).
        context: ``context(step)``, a note for gradient findings (what FSDP2
            passed the comm).
        diagnose: ``diagnose(step)``, run on every rank once any rank found a
            difference in ``step``: findings of kind ``"diagnosis"`` naming the
            causes that reproduce the hook's result (:mod:`conformance.ranks.diagnosis`).
        reduce_dtype: the hook's claimed reduce dtype (``spec.reduce_dtype``):
            gradient mismatches count their ULPs in it too; ``None`` for a
            full-precision claim.
        findings_so_far: ``findings_so_far(step)``: what the recorder has seen
            go wrong in the step so far (a buffer of the wrong shape), never what
            only a finished step shows (a hook never called). Reported above the
            traceback when the step raises (:meth:`RankContext.report_on_error`).
    """

    ref: nn.Module
    hooked: nn.Module
    inputs: Any
    loss_fn: Any
    reference: str
    grads: Sequence[View]
    params: Optional[View]
    hook_findings: Callable[[int], List[Finding]]
    start_step: Callable[[int], None] = lambda step: None
    train: Callable[..., None] = train_step
    guard_hooked: Optional[Callable[[int, Callable[[], None]], Optional[List[Finding]]]] = None
    context: Optional[Callable[[int], str]] = None
    diagnose: Optional[Callable[[int], List[Finding]]] = None
    findings_so_far: Optional[Callable[[int], List[Finding]]] = None
    reduce_dtype: Optional[torch.dtype] = None


class LockstepRun:
    """One lock-step training of ``plan``: its optimizers and step count, kept between calls.

    :func:`lockstep` runs one from scratch; hard inputs keep one per case on
    the rank (:mod:`conformance.ranks.checks.hard_inputs`), so each further example
    costs one forward/backward, not a rebuild. Steps are numbered from 0 across
    calls; ``plan.inputs(step)`` and ``plan.context(step)`` see that number.
    """

    def __init__(self, plan: Lockstep, lr: float):
        self.plan = plan
        self.step = 0
        self.opt_ref = torch.optim.SGD(plan.ref.parameters(), lr=lr, momentum=0.9)
        self.opt_hooked = torch.optim.SGD(plan.hooked.parameters(), lr=lr, momentum=0.9)

    def run(self, ctx: Any, steps: int) -> List[Finding]:
        """Train ``steps`` more steps; stop at the first with findings, once every rank agrees."""
        so_far = self.plan.findings_so_far
        for _ in range(steps):
            step = self.step
            if so_far is not None:
                ctx.report_on_error(lambda: so_far(step))
            stop, findings = self._one_step(ctx, step)
            if so_far is not None:
                ctx.report_on_error(None)
            self.step += 1
            if stop:
                return findings
        return []

    def _one_step(self, ctx: Any, step: int) -> Tuple[bool, List[Finding]]:
        """One step; ``(stop, findings)``: ``stop`` when any rank found something (the same on every rank)."""
        plan = self.plan
        plan.start_step(step)
        inputs = plan.inputs(step) if callable(plan.inputs) else plan.inputs
        plan.train(ctx, "reference", step, plan.ref, self.opt_ref, inputs, plan.loss_fn)

        def hooked_step() -> None:
            plan.train(ctx, "hooked", step, plan.hooked, self.opt_hooked, inputs, plan.loss_fn)

        if plan.guard_hooked is None:
            hooked_step()
        else:
            broken = plan.guard_hooked(step, hooked_step)
            if broken:
                return True, broken
        findings = plan.hook_findings(step)
        note = plan.context(step) if plan.context else ""
        against = f"{plan.reference} ({note})" if note else plan.reference
        for what, named, phase in plan.grads:
            if phase:
                ctx.phase(f"step {step}: {phase}")
            findings += compare_named(what, named(plan.hooked), named(plan.ref), rank=ctx.rank, step=step,
                                      reference=against, reduce_dtype=plan.reduce_dtype)
            if ctx.any_rank(bool(findings)):
                if plan.diagnose is not None:
                    ctx.phase(f"step {step}: diagnosing the difference")
                    findings += plan.diagnose(step)
                return True, findings
        if plan.params is None:
            return False, []
        ctx.phase(f"step {step}: optimizer step")
        self.opt_ref.step()
        self.opt_hooked.step()
        what, named, _ = plan.params
        findings = compare_named(what, named(plan.hooked), named(plan.ref), rank=ctx.rank, step=step,
                                 reference=plan.reference)
        return ctx.any_rank(bool(findings)), findings


#: ``max_norm`` of the clip_grad_norm_ cases: small enough that every reference model's gradients
#: are scaled down (so the clipped gradients, not only the norm, carry the result).
CLIP_MAX_NORM = 1e-2
#: The norm types of the clip_grad_norm_ cases (PyTorch's test_fsdp_clip_grad_norm.py uses 2 and inf).
CLIP_NORM_TYPES = (2.0, float("inf"))


def clipping(train: Callable[..., None], clip: Callable[[nn.Module], torch.Tensor], norm_type: float,
             norms: Dict[int, torch.Tensor]) -> Callable[..., None]:
    """The API's training step ``train`` followed by ``clip(model)``, announced as a phase; the total norm
    each model's ``clip`` returns is kept in ``norms[id(model)]`` (flattened, detached)."""
    def train_and_clip(ctx: Any, label: str, step: int, model: nn.Module, optim: Any, inputs: Any,
                       loss_fn: Any) -> None:
        train(ctx, label, step, model, optim, inputs, loss_fn)
        ctx.phase(f"step {step}: clip_grad_norm_(max_norm={CLIP_MAX_NORM}, norm_type={norm_type}) of the "
                  f"{label} model")
        norms[id(model)] = clip(model).detach().reshape(-1)

    return train_and_clip


def clipped(plan: Lockstep, clip: Callable[[nn.Module], torch.Tensor], norm_type: float) -> Lockstep:
    """``plan`` with ``clip(model)`` (the API's ``clip_grad_norm_``) after every backward of both models.

    The total norm each returns is compared bitwise first (the view ``"total gradient norm"``),
    then the clipped gradients as ``plan`` compares them. ``clip`` returns the total norm as a
    plain tensor (an FSDP2 ``DTensor`` norm as its ``full_tensor()``).
    """
    norms: Dict[int, torch.Tensor] = {}

    def total_norm(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        return {f"total norm (norm_type={norm_type})": norms.get(id(model))}

    note = plan.context
    return dataclasses.replace(
        plan, train=clipping(plan.train, clip, norm_type, norms), grads=[("total gradient norm", total_norm, "")] + [
            (f"clipped {what}", named, phase) for what, named, phase in plan.grads],
        context=lambda step: f"clip_grad_norm_ norm_type={norm_type}" + (f"; {note(step)}" if note else ""))


def clip_with_torch(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters (DDP, FSDP2); a ``DTensor`` total norm
    (FSDP2) as its ``full_tensor()``."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_without_backward(ctx: Any, model: nn.Module, label: str, inputs: Any,
                          clip: Callable[[nn.Module], torch.Tensor]) -> Tuple[torch.Tensor, List[str]]:
    """``zero_grad(set_to_none=True)``, one forward of ``model`` on ``inputs`` with no backward, then
    ``clip(model)``: the total norm and the warnings ``clip`` gave (PyTorch's ``test_no_gradients`` in
    test_fsdp_clip_grad_norm.py: FSDP's ``clip_grad_norm_`` returns a float32 zero and warns that the rank
    has no gradients)."""
    import warnings

    ctx.phase(f"after training: a forward of the {label} model with no backward, then clip_grad_norm_")
    model.zero_grad(set_to_none=True)
    model(*inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = clip(model).detach().reshape(-1)
    return norm, sorted({str(w.message) for w in caught})


def _without_backward_findings(ctx: Any, plan: Lockstep, inputs: Any, clip: Callable[[nn.Module], torch.Tensor],
                               norm_type: float) -> List[Finding]:
    """Both models of ``plan`` through :func:`clip_without_backward`: the total norms bitwise (dtype too), and
    the same warnings, with the hook registered as without it."""
    ref_norm, ref_warned = clip_without_backward(ctx, plan.ref, "reference", inputs, clip)
    norm, warned = clip_without_backward(ctx, plan.hooked, "hooked", inputs, clip)
    where = f"{plan.reference} (a forward with no backward, then clip_grad_norm_ norm_type={norm_type})"
    findings = compare_named("total gradient norm", {"total norm": norm}, {"total norm": ref_norm}, rank=ctx.rank,
                             step=None, reference=where)
    if warned != ref_warned:
        findings.append(Finding(ctx.rank, f"clip_grad_norm_ warned {warned or 'nothing'} with the hook, but "
                                          f"{ref_warned or 'nothing'} on {where}"))
    return findings


def clip_grad_norm_parity(ctx: Any, make_plan: Callable[[], Lockstep], *, steps: int, lr: float,
                          clip: Callable[[nn.Module, float, float], torch.Tensor] = clip_with_torch,
                          without_backward: Optional[Callable[[Lockstep], Any]] = None,
                          make_reference: Optional[Callable[[], Tuple[nn.Module, Any, Any]]] = None,
                          train: Callable[..., None] = train_step) -> List[Finding]:
    """The clip_grad_norm_ check of every API: for each of :data:`CLIP_NORM_TYPES`, a fresh plan from
    ``make_plan()`` trained in lock step with ``clip(model, CLIP_MAX_NORM, norm_type)`` after every backward
    (:func:`clipped`); the findings of the first norm type that differs, every rank stopping together.

    ``without_backward(plan)``: the inputs of a last forward with no backward after training, on both
    models, whose ``clip`` must give the same total norm and warnings (:func:`clip_without_backward`);
    ``None`` leaves it out. ``make_reference()``: the reference alone, ``(model, inputs, loss_fn)``, trained
    with ``train`` and clipped the same way, with no hooked model built (the runner's ``reference_only``
    replay, :data:`conformance.ranks.checks.REPLAYS_REFERENCE`); returns no findings.
    """
    for norm_type in CLIP_NORM_TYPES:
        clip_one = lambda m, t=norm_type: clip(m, CLIP_MAX_NORM, t)  # noqa: E731
        if make_reference is not None:
            ref, inputs, loss_fn = make_reference()
            train_alone(ctx, ref, torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9), inputs, loss_fn, steps,
                        train=clipping(train, clip_one, norm_type, {}))
            continue
        plan = clipped(make_plan(), clip_one, norm_type)
        findings = lockstep(ctx, plan, steps=steps, lr=lr)
        if not ctx.any_rank(bool(findings)) and without_backward is not None:
            findings = _without_backward_findings(ctx, plan, without_backward(plan), clip_one, norm_type)
        if ctx.any_rank(bool(findings)):
            return findings
    return []


def lockstep(ctx: Any, plan: Lockstep, *, steps: int, lr: float) -> List[Finding]:
    """Train ``plan.ref`` and ``plan.hooked`` side by side with SGD (momentum 0.9) for ``steps`` steps.

    Per step: the reference's forward/backward, the hooked model's, the hook
    recorder's findings and every gradient view compared bitwise; then both
    optimizer steps and the parameters compared bitwise (unless ``plan.params``
    is ``None``). Stops at the first step with findings, once every rank agrees
    (``ctx.any_rank``), so no rank is left waiting in a collective.

    Returns:
        this rank's findings (empty when the hook conforms).
    """
    return LockstepRun(plan, lr).run(ctx, steps)


def averaging_findings(ctx: Any, grads: Dict[str, Optional[torch.Tensor]], step: int, *,
                       expected: Optional[Dict[str, Any]] = None, what: str = "",
                       skip_missing: bool = False) -> List[Finding]:
    """One step of the analytic averaging check (``Linear(1, world_size)``, input = rank).

    Every gradient must equal the mean over ranks of the local gradients,
    ``mean(0..world_size-1)`` (or, when ``expected`` is given, ``expected[fqn]``,
    described by ``what``). When every rank still holds exactly its own local
    gradient (rank ``r`` holds ``r`` everywhere), the result is one finding of
    kind ``"local_gradient"`` instead: the hook never communicated. That needs
    an all-reduce, so every rank must call this at the same point.

    ``skip_missing``: a gradient that is ``None`` or empty is not a finding
    (FSDP's local shard of a small parameter can be empty).
    """
    mean = sum(range(ctx.world_size)) / ctx.world_size
    findings: List[Finding] = []
    kept_local = True
    for fqn, grad in grads.items():
        if grad is None or (skip_missing and grad.numel() == 0):
            if not skip_missing:
                findings.append(Finding(ctx.rank, "gradient is None after backward", step=step, fqn=fqn))
                kept_local = False
            continue
        kept_local = kept_local and compare_bitwise(grad, torch.full_like(grad, float(ctx.rank))) is None
        if expected is None:
            want, desc = torch.full_like(grad, mean), f"mean(0..{ctx.world_size - 1}) = {mean!r}"
        else:
            want, desc = expected[fqn], what
        mismatch = compare_bitwise(grad, want)
        if mismatch is not None:
            findings.append(Finding(ctx.rank, f"gradient is not the average over ranks, {desc}", step=step,
                                    fqn=fqn, mismatch=mismatch))
    if ctx.world_size > 1 and not ctx.any_rank(not kept_local):
        return [Finding(ctx.rank, f"the hook's reduction never reached the gradients: after the hook every rank "
                                  f"still holds its own local gradient (rank {ctx.rank} holds {float(ctx.rank)!r} "
                                  f"everywhere) instead of the average over ranks, {mean!r}; ranks train apart",
                        step=step, kind="local_gradient")]
    return findings


def grads_per_step(ctx: Any, hooked: nn.Module, optim: torch.optim.Optimizer, inputs: Sequence[Any], loss_fn: Any,
                   steps: int, *, named: Callable[[nn.Module], Dict[str, Optional[torch.Tensor]]],
                   train: Callable[..., None] = train_step, start_step: Callable[[int], None] = lambda step: None,
                   guard_hooked: Optional[Callable[[int, Callable[[], None]], Optional[List[Finding]]]] = None
                   ) -> CheckResult:
    """Train the hooked model alone and keep its gradients after every step, for a cross-rank comparison.

    Returns:
        a :class:`CheckResult` whose ``grads`` are ``{fqn: CPU tensor or None}``
        per step, and whose findings are what ``guard_hooked`` reported when the
        hook broke the API's contract, which ends the training early.
    """
    per_step: List[Dict[str, Optional[torch.Tensor]]] = []
    for step in range(steps):
        start_step(step)

        def run() -> None:
            train(ctx, "hooked", step, hooked, optim, inputs, loss_fn)

        broken = run() if guard_hooked is None else guard_hooked(step, run)
        if broken:
            return CheckResult(findings=broken, grads=per_step)
        per_step.append({k: (None if g is None else g.cpu().clone()) for k, g in named(hooked).items()})
        optim.step()
    return CheckResult(grads=per_step)
