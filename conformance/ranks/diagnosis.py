"""Why a hook's result differs from native: named causes, each tested bit for bit on the hook's own calls.

Every API's recorder keeps, for every call of the hook under test, a
:class:`HookCall`: the local gradient the hook received (a clone taken before
the call), the result it produced (FSDP1: its ``output`` shard, or the gradient
it reduced in place under ``NO_SHARD``; DDP: the tensor its future holds; FSDP2:
the comm's output buffer, or the tensor an all-reduce hook left), and how many
``torch.distributed`` collectives it issued. When a case finds a difference,
every rank runs :func:`diagnose` on the calls of the failing step: it
recomputes, **with the same collectives on the same process group**, what each
named cause would have produced from those inputs, and reports every cause
whose result equals the hook's bit for bit.

The causes of a reduction are the API's own :class:`~conformance.ranks.arithmetic.Arithmetic`
(its models hand it over; this module names no API):

* native's own arithmetic (the hook's result is right; the difference arose after it);
* SUM without averaging; averaged twice;
* another rounding order: SUM then divide by the world size, or divide before the
  SUM, where native multiplies by ``1/N`` (DDP's ``Reducer``) or pre- and
  post-divides (FSDP's ``_div_if_needed`` with ``_get_gradient_predivide_factor``);
* native's arithmetic in another dtype than the one claimed;
* the shard of another rank (reduce-scatter, or an all-reduce and the wrong chunk);
* an all-reduce then this rank's chunk, where native reduce-scatters (another summation order);
* for an FSDP2 all-reduce hook, a second division or reduction of native HSDP's result.

and here, for every API:

* the result of the previous step (stale);
* the local, unreduced gradient, telling "never communicated" (no collective
  seen) from "communicated, but returned the local gradient" (DDP then copies
  it over whatever the hook reduced);
* NaN or Inf replaced (equal to native except where native is not finite);
* a tail or a range of the buffer left unreduced (first and last differing index).

A call none of them explains is reported as "no known cause". Candidates run
collectives, so every rank of the group must call :func:`diagnose` at the same
point with the same number of calls; it checks that first and gives up (with a
line saying so) otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from conformance.protocol import Finding
from conformance.ranks.compare import compare_bitwise, dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.arithmetic import Arithmetic  # typing only

#: ``torch.distributed`` functions counted while the hook runs (:func:`counting_collectives`).
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_gather",
               "all_gather_into_tensor", "_all_gather_base", "broadcast", "reduce", "all_to_all_single",
               "all_to_all", "gather", "scatter")
#: Recorded calls kept per recorder: the failing step and the one before it (for "stale").
KEEP_STEPS = 2
#: Calls explained per failing step: each costs a dozen collectives, and the first ones tell the cause.
MAX_DIAGNOSED_CALLS = 2


@dataclasses.dataclass
class HookCall:
    """One call of the hook under test on this rank.

    Attributes:
        step: the training step (0-based).
        index: the call's position among the step's calls (DDP: the bucket index).
        where: what the call reduced, for messages (``"bucket 0 [fc.weight, ...]"``).
        input: the local gradient the hook received, 1-D, cloned before the call.
        output: what the hook produced, 1-D (the shard of a reduce-scatter).
        sharded: ``output`` is this rank's shard of a reduce-scatter over ``input``
            (``input.numel() == world_size * output.numel()``), else an all-reduce.
        collectives: ``torch.distributed`` collectives the hook issued during the call.
        group: the process group the API passed the hook (FSDP2), else ``None``
            (the rank check's group).
        op: the ``ReduceOp`` the API asked for (FSDP2), else ``None``.
        pending: the API's output buffer, read (cloned into ``output``) once the
            call has completed (FSDP2 may wait on a comm after it returns).
    """

    step: int
    index: int
    where: str
    input: torch.Tensor
    output: Optional[torch.Tensor] = None
    sharded: bool = False
    collectives: int = 0
    group: Any = None
    op: Any = None
    pending: Optional[torch.Tensor] = None

    def settle_from(self, tensor: torch.Tensor) -> None:
        """Read the call's result from ``tensor`` now."""
        self.pending = tensor
        self.settle()

    def settle(self) -> None:
        """Clone the pending output buffer into ``output`` (the call has completed)."""
        if self.pending is not None:
            self.output, self.pending = self.pending.detach().reshape(-1).clone(), None


class CallLog:
    """The :class:`HookCall` s of a recorder, the last :data:`KEEP_STEPS` steps only."""

    def __init__(self) -> None:
        self.calls: List[HookCall] = []

    def add(self, call: HookCall) -> HookCall:
        for old in self.calls:
            if old.step < call.step:
                old.settle()  # a call of an earlier step has completed; its buffer may be reused now
        self.calls = [c for c in self.calls if c.step > call.step - KEEP_STEPS] + [call]
        return call

    def of_step(self, step: int) -> List[HookCall]:
        """The completed calls of ``step`` with a result, by index (pending buffers read now)."""
        for call in self.calls:
            if call.step == step:
                call.settle()
        return sorted((c for c in self.calls if c.step == step and c.output is not None), key=lambda c: c.index)


@contextlib.contextmanager
def counting_collectives() -> Iterator[List[int]]:
    """Count calls of the :data:`COLLECTIVES` through ``torch.distributed`` inside the block.

    Yields a one-element list whose item is the count so far. Calls made
    through a name imported before the block (``from torch.distributed import
    all_reduce``) are not seen, so "no collective seen" is worded as such.
    """
    count = [0]
    saved: Dict[str, Any] = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def counted(*args: Any, __fn: Callable = fn, **kwargs: Any) -> Any:
            count[0] += 1
            return __fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield count
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and compare_bitwise(a, b, check_device=False) is None


def _partial(output: torch.Tensor, native: torch.Tensor, local: torch.Tensor) -> Optional[str]:
    """Where ``output`` equals ``native`` but for one contiguous range that holds the local values."""
    if output.shape != native.shape:
        return None
    o, n = output.double(), native.double()
    differs = ~((o == n) | (torch.isnan(o) & torch.isnan(n)))
    idx = differs.nonzero().flatten()
    if idx.numel() == 0:
        return None
    first, last = int(idx[0]), int(idx[-1])
    if not _same(output[first:last + 1], local[first:last + 1]):
        return None
    size = output.numel()
    part = f"the tail from element {first} ({size - first} of {size})" if last == size - 1 else \
        f"elements {first}..{last} ({last - first + 1} of {size})"
    return f"{part} left unreduced (the local gradient), the rest equal to native"


def _nonfinite_replaced(output: torch.Tensor, native: torch.Tensor) -> Optional[str]:
    bad = ~torch.isfinite(native.double())
    if not bool(bad.any()) or output.shape != native.shape:
        return None
    if not _same(output[~bad], native[~bad]):
        return None
    replaced = bad & torch.isfinite(output.double())
    if not bool(replaced.any()):
        return None
    values = sorted({float(v) for v in output[replaced].double().tolist()})[:3]
    return (f"NaN or Inf replaced: equal to native except at {int(replaced.sum())} element(s) where native is "
            f"NaN/Inf and the hook left {', '.join(repr(v) for v in values)}")


def explain(arith: "Arithmetic", call: HookCall, previous: Optional[HookCall], group: Any, rank: int) -> List[str]:
    """Every named cause that reproduces ``call.output`` bit for bit (collective: every rank calls it).

    The causes are ``arith``'s (:meth:`~conformance.ranks.arithmetic.Arithmetic.candidates`, native first),
    then what any API's hook may do: return its local gradient, a step's old result, NaN or Inf replaced,
    a range left unreduced.
    """
    candidates = arith.candidates(call, group, rank)
    out = call.output
    causes = [name for name, value in candidates if _same(out, value)]
    native = candidates[0][1]
    local = arith.unreduced(call, rank)
    if _same(out, local) and not _same(native, local):
        causes.append("the local, unreduced gradient: " + (
            f"the hook issued {call.collectives} collective(s), but its result is the local gradient it "
            "received (the reduced values went elsewhere, and the API copied the unreduced result over them)"
            if call.collectives else
            "the hook never communicated (no torch.distributed collective was seen during the call)"))
    if previous is not None and previous.output is not None and _same(out, previous.output) \
            and not _same(out, native):
        causes.append(f"the result of step {previous.step} (stale): the hook returned what it produced a step earlier")
    partial = None if _same(out, local) else _partial(out, native, local)
    for extra in (_nonfinite_replaced(out, native), partial):
        if extra:
            causes.append(extra)
    return causes


def diagnose(ctx: Any, arith: "Arithmetic", log: CallLog, step: int) -> List[Finding]:
    """The diagnosis of ``step`` on this rank: one finding per group of calls with the same explanation, of
    kind ``"diagnosis"`` (named causes), ``"diagnosis_wider_dtype"`` (only a reduction in a wider dtype
    than claimed explains it: more accurate than native), ``"no_known_cause"``, or ``"native_result"``
    (every call of this rank equals native's arithmetic: what differs arose after the hook returned).

    Collective: every rank of ``ctx.group`` must call it at the same point.
    Returns a single "cannot diagnose" finding when the ranks recorded
    different numbers of calls (the candidates' collectives would not match).
    """
    calls = log.of_step(step)
    counts = torch.tensor([len(calls), -len(calls)], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=ctx.group)
    if int(counts[0]) != -int(counts[1]):
        return [Finding(ctx.rank, "not attempted: the ranks recorded different numbers of hook calls in this step",
                        step=step, kind="no_known_cause")]
    if not calls:
        return []
    previous = {c.index: c for c in log.calls if c.step == step - 1}
    groups: Dict[Tuple[str, ...], List[HookCall]] = {}
    native_ok: List[HookCall] = []
    def context(call: HookCall) -> Tuple[Any, int, "Arithmetic"]:
        # The group the API passed the hook (FSDP2), else the check's: a subgroup context keeps the global
        # rank in ctx.rank, so the rank in the group is asked for.
        group = ctx.group if call.group is None else call.group
        return group, dist.get_rank(group), arith.for_call(call)

    # Phase 1, one collective per call: which calls differ from native on any rank. Phase 2 explains at
    # most MAX_DIAGNOSED_CALLS of those (each costs a dozen collectives).
    differs = torch.tensor([0 if _same(c.output, context(c)[2].native_result(c, context(c)[0])) else 1
                            for c in calls], dtype=torch.int64)
    mine = differs.clone()
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=ctx.group)
    chosen = [c for c, d in zip(calls, differs.tolist()) if d][:MAX_DIAGNOSED_CALLS]
    skipped = int(differs.sum()) - len(chosen)
    for call in chosen:
        group, rank, arith_call = context(call)
        causes = explain(arith_call, call, previous.get(call.index), group, rank)
        if causes and causes[0] == "native":
            continue
        groups.setdefault(tuple(causes), []).append(call)
    if not int(mine.sum()):
        native_ok = list(calls)
    findings: List[Finding] = []
    if skipped:
        findings.append(Finding(ctx.rank, f"{skipped} more hook call(s) of the step differ from native on some rank; "
                                          f"the diagnosis explains the first {MAX_DIAGNOSED_CALLS}", step=step,
                                kind="diagnosis_note"))
    for causes, which in groups.items():
        where = "every hook call of the step" if len(which) == len(calls) else \
            f"{len(which)} of {len(calls)} hook calls ({_names(which)})"
        if causes:
            text = "; or ".join(causes)
            kind = "diagnosis_wider_dtype" if _only_wider_dtype(causes, arith.reduce_dtype) else "diagnosis"
            findings.append(Finding(ctx.rank, f"in {where}, the hook's result is explained, bit for bit, by: {text}",
                                    step=step, kind=kind))
        else:
            findings.append(Finding(ctx.rank, f"no known cause explains the hook's result in {where}",
                                    step=step, kind="no_known_cause"))
    if native_ok and len(native_ok) == len(calls):
        findings.append(Finding(ctx.rank, "the hook's own result equals native's arithmetic bit for bit in every "
                                          "call; what differs arose after the hook returned", step=step,
                                kind="native_result"))
    return findings


def _only_wider_dtype(causes: Sequence[str], claim: Optional[torch.dtype]) -> bool:
    """Whether one of the causes is a reduction in a more precise dtype than the claimed one (finer ``eps``):
    more accurate than native, which may be a lossy design worth a contract rather than a bug. Such a
    diagnosis has kind ``"diagnosis_wider_dtype"``."""
    claimed = torch.finfo(claim or torch.float32).eps
    finer = [f"reduced in {dtype_name(d)}," for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
             if torch.finfo(d).eps < claimed]
    return any(c.startswith(w) for c in causes for w in finer)


def _names(calls: Sequence[HookCall]) -> str:
    shown = ", ".join(c.where for c in calls[:3])
    return shown + (", ..." if len(calls) > 3 else "")
