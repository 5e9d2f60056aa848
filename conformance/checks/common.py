"""What the rank checks of every API share: one training step, and comparing named tensors.

``compare_named`` is the one place where "the hooked model's gradient (or
parameter) for this FQN equals the reference's bit for bit" becomes findings,
for FSDP, DDP and FSDP2 alike.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
from torch import nn

from conformance.compare import compare_bitwise
from conformance.protocol import Finding


def compare_named(what: str, actual: Dict[str, Any], expected: Dict[str, Any], *, rank: int, step: int,
                  reference: str = "the native path") -> List[Finding]:
    """Findings for every FQN of ``expected`` whose tensor in ``actual`` is not bitwise equal.

    Args:
        what: what the tensors are, e.g. ``"gradient"``; starts each message.
        actual: FQN -> tensor (or ``None``) of the hooked model on this rank.
        expected: FQN -> tensor (or ``None``) of the reference model on this rank.
        rank, step: where the comparison happened, for the findings.
        reference: the reference's name in messages, e.g. ``"DDP with no hook"``.

    A tensor present on one side and ``None`` on the other is a finding too.
    Comparison is :func:`conformance.compare.compare_bitwise` (NaN equals NaN).
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
        mismatch = compare_bitwise(act, exp)
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
