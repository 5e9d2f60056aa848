"""A case's findings as the controller judges them: every rank's own, and, for checks of identical gradients on
every rank, each rank's gradients against rank 0's (what DDP and FSDP ``NO_SHARD`` guarantee)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from conformance.protocol import CaseResult, Finding
from conformance.shared.compare import compare_bitwise

__all__ = ["compare_across_ranks", "findings_of"]


def findings_of(result: CaseResult, across_ranks: bool) -> List[Finding]:
    """Every rank's findings; with ``across_ranks`` and none but a diagnosis (the ranks diagnose the first step
    whose gradients differ across them), each rank's gradients against rank 0's, then that diagnosis; then what
    the hook left in its ranks (:meth:`CaseResult.leak_findings`)."""
    found = [f for o in result.outcomes for f in o.value.findings]
    if across_ranks and all(f.kind.explains for f in found):
        found = compare_across_ranks([o.value.grads for o in result.outcomes]) + found
    return found + result.leak_findings()


def compare_across_ranks(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> List[Finding]:
    """Findings where a rank's gradients differ from rank 0's, step by step.

    ``per_rank[r][step][fqn]`` is rank ``r``'s gradient (CPU tensor or ``None``).
    Mirrors what DDP and FSDP ``NO_SHARD`` guarantee: after the reduction every
    rank holds the identical gradient.
    """
    findings: List[Finding] = []
    base = per_rank[0]
    for rank, steps in enumerate(per_rank[1:], start=1):
        for step, (mine, theirs) in enumerate(zip(steps, base)):
            for fqn, ref in theirs.items():
                got = mine.get(fqn)
                if (got is None) != (ref is None):
                    findings.append(Finding(rank, "gradient presence differs from rank 0", step=step, fqn=fqn))
                    continue
                if got is None:
                    continue
                mismatch = compare_bitwise(got, ref)
                if mismatch is not None:
                    findings.append(Finding(rank, "gradient differs from rank 0's after the reduction",
                                            step=step, fqn=fqn, mismatch=mismatch))
            if findings:
                return findings
    return findings
