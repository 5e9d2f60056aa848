"""What the rank checks of every API share: named tensors, one training step, comparing them bit for bit.

``compare_named`` is the one place where "the hooked model's gradient (or
parameter) for this FQN equals the reference's bit for bit" becomes findings;
:func:`train_step` is the one training step of every API (DDP's ``no_sync``
micro-steps included). The lock-step loop built on them is
:mod:`conformance.ranks.checks.lockstep`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.shared.compare import compare_bitwise
from conformance.shared.standalone_compare import fqn_without_wrappers, local
from conformance.ulps import INT_OF_SIZE
from conformance.protocol import REFERENCE_DIGEST, CheckResult, Finding, FindingKind
from conformance.catalogue import CATALOGUE

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.ranks.checks.models import Recorder

#: The rank functions of the shared checks, by catalogue name (:func:`shared_check`).
SHARED_CHECKS: Dict[str, Callable[..., Any]] = {}


def shared_check(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated ``run(ctx, spec, make, **params)`` as the rank function of the catalogue's check
    ``name`` (:data:`conformance.catalogue.CATALOGUE`); every API whose suite tests run it binds it to its models
    class ``make`` (:func:`conformance.ranks.checks.register_every_check`).

    Raises:
        KeyError: the catalogue declares no check ``name``.
        ValueError: another function is registered for it already.
    """
    if name not in CATALOGUE:
        raise KeyError(f"no check {name!r} in the catalogue (conformance/catalogue.py); declare it there first")

    def register(run: Callable[..., Any]) -> Callable[..., Any]:
        if SHARED_CHECKS.get(name, run) is not run:
            raise ValueError(f"check {name!r}: {run.__qualname__} and {SHARED_CHECKS[name].__qualname__} both "
                             "register as its rank function")
        SHARED_CHECKS[name] = run
        return run

    return register

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
    Comparison is :func:`conformance.shared.compare.compare_bitwise` (NaN equals NaN).
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


class _SGD(torch.optim.SGD):
    """``torch.optim.SGD(foreach=False)`` with no weight decay, dampening or Nesterov momentum, whose update runs on
    the local shard of a DTensor parameter (FSDP2) whose gradient is a DTensor of the same placements and mesh.

    The same elementwise operations on the same local tensors as ``torch.optim.sgd._single_tensor_sgd`` (``buf =
    grad.clone()`` at the first step, then ``buf.mul_(momentum).add_(grad)``; ``param.add_(buf, alpha=-lr)``), so
    the bits are PyTorch's SGD's, the reproducers' optimizer's; what it leaves out is DTensor's sharding
    propagation, which PyTorch recomputes for every ``add_`` with an ``alpha`` (its C++ cache does not key that
    call): 0.6 ms a step against 0.2 ms for 12 sharded parameters on one CPU rank (torch 2.13), thousands of
    times in a long run, for nothing a hook can change."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Any:  # type: ignore[override]
        if closure is not None:
            return super().step(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                param, grad = _same_layout_locals(p, p.grad)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = grad.detach().clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1)
                    grad = buf
                param.add_(grad, alpha=-lr)
        return None


def _same_layout_locals(param: torch.Tensor, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(param, grad)`` as their local shards where both are DTensors of the same placements on the same mesh,
    else as they are (DTensor's own dispatch then does what PyTorch's SGD would)."""
    if (hasattr(param, "to_local") and hasattr(grad, "to_local") and param.placements == grad.placements
            and param.device_mesh == grad.device_mesh):
        return param.to_local(), grad.to_local()
    return param, grad


def sgd(params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0) -> torch.optim.SGD:
    """``torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=False)``: every check's optimizer, the
    reference's and the hooked model's alike (the same bits, computed on an FSDP2 parameter's local shard:
    :class:`_SGD`).

    ``foreach=False`` keeps one code path on every device: left to choose, SGD takes its for-loop on the
    CPU and its ``_foreach`` kernels where every tensor is on CUDA, which raise on a parameter whose
    gradient a hook left in another dtype ("Tensors of the same index must be on the same device and the
    same dtype"), where the for-loop adds it. A check must judge the hook alike on CPU and GPU ranks."""
    return _SGD(params, lr=lr, momentum=momentum, foreach=False)


def model_no_sync(model: nn.Module) -> ContextManager[Any]:
    """``model.no_sync()``: gradient accumulation as DDP and FSDP1 do it
    (``DistributedDataParallel.no_sync``, ``FullyShardedDataParallel.no_sync``)."""
    return model.no_sync()


def train_step(ctx: CheckContext, label: str, step: int, model: nn.Module, optim: torch.optim.Optimizer,
               inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Callable[..., torch.Tensor],
               no_sync: Callable[[nn.Module], ContextManager[Any]] = model_no_sync) -> None:
    """Zero the gradients, then forward/backward ``model`` on each micro-step's inputs, announced as phases;
    all but the last micro-step under ``no_sync(model)``, the API's gradient accumulation
    (:meth:`~conformance.ranks.checks.models.ApiModels.no_sync`: ``model.no_sync()`` for DDP and FSDP1,
    ``set_requires_gradient_sync(False)`` for FSDP2). One micro-step unless the case accumulates."""
    optim.zero_grad(set_to_none=True)
    for k, micro in enumerate(inputs):
        last = k == len(inputs) - 1
        ctx.phase(f"step {step}: forward/backward of the {label} model"
                  + ("" if len(inputs) == 1 else f" (micro-step {k}{'' if last else ', no_sync'})"))
        if last:
            loss_fn(micro, model(*micro)).backward()
        else:
            with no_sync(model):
                loss_fn(micro, model(*micro)).backward()


def hooked_step(recorder: Recorder, train: Callable[..., None], ctx: CheckContext, label: str, step: int,
                model: nn.Module, optim: torch.optim.Optimizer, inputs: Sequence[Tuple[torch.Tensor, ...]],
                loss_fn: Callable[..., torch.Tensor],
                no_sync: Callable[[nn.Module], ContextManager[Any]] = model_no_sync) -> Optional[List[Finding]]:
    """One training step ``step`` of the hooked ``model``, ``train(ctx, label, step, model, optim, inputs, loss_fn,
    no_sync=no_sync)`` (:func:`train_step`, or the API's), its recorder told before and after
    (:meth:`~conformance.ranks.checks.models.Recorder.begin_step`, ``step_failed``, ``end_step``). The step trains
    here, in the check's call, so nothing of the recorder's stands between the check and the hook but its wrapper
    around the hook.

    Returns:
        the findings that end the check where the hook broke the API's contract so that the step means nothing
        (DDP's future; a hook DDP refused), else ``None``.

    Raises:
        Exception: what the training step raised, where the recorder has no contract finding that explains it
            (the hook's own error).
    """
    broken = recorder.begin_step(step)
    if broken is not None:
        return broken
    try:
        train(ctx, label, step, model, optim, inputs, loss_fn, no_sync=no_sync)
    except Exception as exc:  # noqa: BLE001 - re-raised unless the recorder saw the hook break the contract first
        broken = recorder.step_failed(step, exc)
        if broken is None:
            raise
        return broken
    return recorder.end_step(step)


def train_alone(ctx: CheckContext, model: nn.Module, optim: torch.optim.Optimizer, inputs: Sequence[Any],
                loss_fn: Callable[..., torch.Tensor], steps: int, train: Callable[..., None] = train_step,
                no_sync: Callable[[nn.Module], ContextManager[Any]] = model_no_sync,
                check: Optional[Callable[[nn.Module, Sequence[Any], int], None]] = None) -> CheckResult:
    """Train the reference model alone for ``steps`` steps, comparing nothing (``reference_only=True``).

    ``train`` is the training step (:func:`train_step`, or it followed by ``clip_grad_norm_``);
    ``check(model, inputs, step)`` the API's analytic check of the reference after each backward
    (:meth:`~conformance.ranks.checks.models.ApiModels.check_reference`), as in lock-step training.
    The same phases as in lock-step training, so a failure here reads the same.
    Returns no findings (:func:`reference_result`): the controller asks whether this raises, and whether two such
    runs end with the same bits.
    """
    for step in range(steps):
        train(ctx, "reference", step, model, optim, inputs, loss_fn, no_sync=no_sync)
        if check is not None:
            check(model, inputs, step)
        ctx.phase(f"step {step}: optimizer step of the reference model")
        optim.step()
    return reference_result(model)


#: Elements summed at a time by :func:`bits_digest` (its memory: three int64 tensors of this many).
_DIGEST_CHUNK = 1 << 20
_MOD = 1 << 64


def bits_digest(tensors: Dict[str, torch.Tensor]) -> str:
    """A digest of the bits of ``tensors`` (any dtypes, any device): equal for two dicts whose tensors have the
    same names, shapes, dtypes and bits, and, short of two 64-bit sums colliding, different otherwise (a
    different NaN payload or a signed zero included). Hex, 16 characters.

    Per tensor, its bits as integers (the dtype's size) summed plainly and weighted by position; one element
    differing changes both sums. Computed with torch on the tensors' device, no copy to the host beyond the sums.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().reshape(-1)
        ints = t.view(INT_OF_SIZE[t.element_size()])
        plain = weighted = 0
        for start in range(0, ints.numel(), _DIGEST_CHUNK):
            part = ints[start:start + _DIGEST_CHUNK].to(torch.int64)
            at = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 1000003 + 1
            plain = (plain + int(part.sum())) % _MOD
            weighted = (weighted + int((part * at).sum())) % _MOD
        digest.update(f"{name}:{tuple(tensors[name].shape)}:{t.dtype}:{plain}:{weighted};".encode())
    return digest.hexdigest()[:16]


def reference_result(*models: nn.Module) -> CheckResult:
    """What a reference-only run returns (``reference_only=True``): no findings, and the figure
    :data:`REFERENCE_DIGEST`, the :func:`bits_digest` of each trained reference's parameters (this rank's local
    shards), so that the controller can tell whether the native path gives the same bits when trained twice
    (:mod:`conformance.controller.attribution`, ``Rule.NATIVE_NOT_REPRODUCIBLE``)."""
    named = {f"{i}.{k}": v for i, m in enumerate(models) for k, v in named_params(m).items()}
    return CheckResult(figures={REFERENCE_DIGEST: bits_digest(named)})


#: ``(what, named tensors of a model, phase to announce first or "")``: one comparison of the loop.
View = Tuple[str, Callable[[nn.Module], Dict[str, Any]], str]


def clip_with_torch(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters (DDP, FSDP2); a ``DTensor`` total norm
    (FSDP2) as its ``full_tensor()``."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def averaging_findings(ctx: CheckContext, grads: Dict[str, Optional[torch.Tensor]], step: int, *,
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
                        step=step, kind=FindingKind.LOCAL_GRADIENT)]
    return findings


def grads_per_step(ctx: CheckContext, hooked: nn.Module, optim: torch.optim.Optimizer, inputs: Sequence[Any],
                   loss_fn: Callable[..., torch.Tensor], steps: int, *,
                   named: Callable[[nn.Module], Dict[str, Optional[torch.Tensor]]],
                   recorder: Recorder,
                   diagnose: Optional[Callable[[int], List[Finding]]] = None) -> CheckResult:
    """Train the hooked model alone and keep its gradients after every step, for a cross-rank comparison.

    Each step trains under the hook's ``recorder`` (:func:`hooked_step`).
    ``diagnose(step)`` (collective): the diagnosis of a step after which the
    ranks' gradients differ (:func:`differs_across_ranks`); the training stops
    there, since the controller reports the first such step.

    Returns:
        a :class:`CheckResult` whose ``grads`` are ``{fqn: CPU tensor or None}``
        per step, and whose findings are what the recorder reported when the
        hook broke the API's contract, which ends the training early, or the
        diagnosis of the first step whose gradients differ across ranks.
    """
    per_step: List[Dict[str, Optional[torch.Tensor]]] = []
    for step in range(steps):
        broken = hooked_step(recorder, train_step, ctx, "hooked", step, hooked, optim, inputs, loss_fn)
        if broken:
            return CheckResult(findings=broken, grads=per_step)
        grads = named(hooked)
        per_step.append({k: (None if g is None else g.cpu().clone()) for k, g in grads.items()})
        if diagnose is not None and differs_across_ranks(ctx, grads):
            ctx.phase(f"step {step}: diagnosing why the ranks' gradients differ")
            return CheckResult(findings=diagnose(step), grads=per_step)
        optim.step()
    return CheckResult(grads=per_step)


def differs_across_ranks(ctx: CheckContext, grads: Dict[str, Optional[torch.Tensor]]) -> bool:
    """Whether any rank of ``ctx.group`` holds other bits than another in ``grads`` (FQN -> tensor or ``None``;
    the same FQNs on every rank, and the same shapes and dtypes where every rank has a gradient).

    Collective, the same answer on every rank: an all-reduce (MAX) of which gradients are present and of
    their negation, then one of every value's bit pattern (at most 32 bits a piece, widened to int64 so its
    negation cannot overflow) and of its negation: the maximum equals the minimum wherever all ranks agree,
    NaN payloads and signed zeros included.
    """
    def spread(values: torch.Tensor) -> bool:
        both = torch.stack([values, -values]).to(ctx.device)  # NCCL reduces no CPU tensor
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
        return bool((both[0] != -both[1]).any())

    if spread(torch.tensor([0 if g is None else 1 for g in grads.values()] or [0], dtype=torch.int64)):
        return True
    parts = [torch.zeros(1, dtype=torch.int64)]
    for g in grads.values():
        if g is not None and g.numel():
            flat = g.detach().reshape(-1).cpu().contiguous()
            parts.append(flat.view(INT_OF_SIZE[min(flat.element_size(), 4)]).to(torch.int64))
    return spread(torch.cat(parts))