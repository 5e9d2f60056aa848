"""Why a hook's result differs from native: named causes, each tested bit for bit on the hook's own calls.

The recorders of the FSDP1 and DDP adapters keep, for every call of the hook
under test, a :class:`HookCall`: the local gradient the hook received (a clone
taken before the call), the result it produced (FSDP1: its ``output`` shard, or
the gradient it reduced in place under ``NO_SHARD``; DDP: the tensor its future
holds), and how many ``torch.distributed`` collectives it issued. When a case
finds a difference, every rank runs :func:`diagnose` on the calls of the failing
step: it recomputes, **with the same collectives on the same process group**,
what each named cause would have produced from those inputs, and reports every
cause whose result equals the hook's bit for bit:

* native's own arithmetic (the hook's result is right; the difference arose after it);
* SUM without averaging; averaged twice;
* another rounding order: SUM then divide by the world size, or divide before the
  SUM, where native multiplies by ``1/N`` (DDP's ``Reducer``) or pre- and
  post-divides (FSDP's ``_div_if_needed`` with ``_get_gradient_predivide_factor``);
* native's arithmetic in another dtype than the one claimed;
* the shard of another rank (reduce-scatter, or an all-reduce and the wrong chunk);
* an all-reduce then this rank's chunk, where native reduce-scatters (another summation order);
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from conformance.ranks.compare import compare_bitwise, dtype_name
from conformance.protocol import Finding

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
    import torch.distributed as dist

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


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """How the native path reduces one buffer: the API, the world size, the claimed reduce dtype.

    * ``"ddp"``, no claim: ``Reducer`` copies the gradient into the bucket
      multiplied by ``1/world_size`` (``at::mul_out`` with a wrapped scalar), then
      SUM; a claim ``X``: cast to ``X``, divide by ``world_size``, SUM, cast back
      (``fp16_compress_wrapper(allreduce_hook)``).
    * ``"fsdp"``: cast to the reduce dtype, divide by the pre-divide factor,
      SUM (all-reduce, or reduce-scatter when sharded), divide by the
      post-divide factor, cast back (``_reduce_grad`` with ``_div_if_needed``).
    * ``"fsdp2_all_reduce"``: an all-reduce hook runs after native HSDP has
      reduced the gradient (``foreach_reduce`` calls it on the result), so native
      is the tensor unchanged; ``divisors`` are the mesh's sizes (replicate,
      shard, world) a hook might wrongly divide by.
    * ``"fsdp2"``: a custom reduce-scatter comm performs exactly the collective
      FSDP2 asks for, ``reduce_scatter_tensor(output, input, op=op, group=group)``
      on the reduce-dtype buffer FSDP2 filled (``foreach_reduce``); FSDP2 does
      any pre- and post-division itself.
    """

    api: str
    world_size: int
    reduce_dtype: Optional[torch.dtype]
    op: Any = None
    divisors: Tuple[int, ...] = ()

    @property
    def factors(self) -> Tuple[float, float]:
        """FSDP's ``(predivide, postdivide)``: ``_get_gradient_predivide_factor`` and its complement."""
        factor = 1
        while self.world_size % factor == 0 and self.world_size / factor > factor:
            factor *= 2
        return float(factor), self.world_size / factor

    def dividing_as(self, world_size: int) -> "Arithmetic":
        """The same arithmetic dividing as for ``world_size`` ranks (the collectives stay on the real group)."""
        return dataclasses.replace(self, world_size=world_size)

    def describe(self) -> str:
        ws = self.world_size
        if self.api == "fsdp2":
            from conformance.apis.fsdp2.recorders import op_name

            return f"FSDP2 asked the comm for op={op_name(self.op)} over {ws} ranks"
        if self.api == "ddp":
            if self.reduce_dtype is None:
                return f"DDP with no hook multiplies by 1/{ws} before the SUM"
            return f"native divides by {ws} in {dtype_name(self.reduce_dtype)} before the SUM"
        pre, post = self.factors
        return f"FSDP pre-divides by {pre:g} and post-divides by {post:g}"


def _reduced(x: torch.Tensor, call: HookCall, group: Any, world_size: int, shift: int = 0,
             op: Any = None) -> torch.Tensor:
    """SUM (or ``op``) of ``x`` over the group: an all-reduce, or (``call.sharded``) a reduce-scatter giving
    this rank the shard of rank ``rank - shift`` (every rank rotates its chunks by ``shift`` first)."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    if not call.sharded:
        t = x.clone()
        dist.all_reduce(t, op=op, group=group)
        return t
    chunks = list(x.chunk(world_size))
    rotated = torch.cat([chunks[(j - shift) % world_size] for j in range(world_size)])
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter_tensor(out, rotated, op=op, group=group)
    return out


def _native(arith: Arithmetic, x: torch.Tensor, call: HookCall, group: Any, dtype: Optional[torch.dtype],
            shift: int = 0, group_size: Optional[int] = None) -> torch.Tensor:
    """Native's arithmetic on ``x`` in ``dtype`` (``None``: the input's own), as ``call.output``'s dtype.

    ``group_size``: the ranks the collective spans, when ``arith`` divides as for another world size.
    """
    ws, size = arith.world_size, group_size or arith.world_size
    t = x.to(dtype) if dtype is not None else x.clone()
    if arith.api == "fsdp2":
        s = _reduced(t, call, group, size, shift, op=arith.op)
    elif arith.api == "ddp":
        t = t.mul(1.0 / ws) if dtype is None or dtype == x.dtype else t.div(ws)
        s = _reduced(t, call, group, size, shift)
    else:
        pre, post = arith.factors
        if pre > 1:
            t = t.div(pre)
        s = _reduced(t, call, group, size, shift)
        if post > 1:
            s = s.div(post)
    return s.to(call.output.dtype)


def _local(call: HookCall, rank: int, world_size: int) -> torch.Tensor:
    """The hook's input as its result would hold it unreduced (this rank's chunk when sharded)."""
    x = call.input.chunk(world_size)[rank] if call.sharded else call.input
    return x.to(call.output.dtype)


def _native_result(arith: Arithmetic, call: HookCall, group: Any) -> torch.Tensor:
    """What native produces from ``call.input`` (the first candidate of :func:`_candidates`), one collective."""
    if arith.api == "fsdp2_all_reduce":
        return call.input.to(call.output.dtype)
    return _native(arith, call.input, call, group, arith.reduce_dtype)


def _all_reduce_hook_candidates(arith: Arithmetic, call: HookCall, group: Any) -> List[Tuple[str, torch.Tensor]]:
    """The causes of an FSDP2 all-reduce hook: native leaves the reduced tensor as it is."""
    import torch.distributed as dist

    x = call.input.to(call.output.dtype)
    out: List[Tuple[str, torch.Tensor]] = [("native", x.clone())]
    for d in sorted(set(arith.divisors)):
        out.append((f"divided by {d} after native HSDP had already averaged it", x.div(d)))
    summed = x.clone()
    dist.all_reduce(summed, group=group)
    out.append(("all-reduced (SUM) again over the default group, mixing the shards of different ranks", summed))
    out.append(("averaged again over the default group, mixing the shards of different ranks",
                summed.div(arith.world_size)))
    return out


def _candidates(arith: Arithmetic, call: HookCall, group: Any, rank: int) -> List[Tuple[str, torch.Tensor]]:
    """``(cause, the result it would give)`` for ``call``; the same collectives, in the same order, on every
    rank (the list depends only on the API, the claim, the world size and the call's shape)."""
    if arith.api == "fsdp2_all_reduce":
        return _all_reduce_hook_candidates(arith, call, group)
    ws, x, claim = arith.world_size, call.input, arith.reduce_dtype
    reduce_in = claim or x.dtype
    out: List[Tuple[str, torch.Tensor]] = [("native", _native(arith, x, call, group, claim))]
    summed = _reduced(x.to(reduce_in), call, group, ws)
    out.append((f"SUM without averaging: {ws} times native's average (the world size)", summed.to(call.output.dtype)))
    out.append((f"averaged twice: native's average divided by {ws} again",
                out[0][1].to(reduce_in).div(ws).to(call.output.dtype)))
    out.append((f"SUM, then divided by {ws}, where {arith.describe()}", summed.div(ws).to(call.output.dtype)))
    if arith.api != "fsdp" or arith.factors[0] != ws:
        out.append((f"divided by {ws} before the SUM, where {arith.describe()}",
                    _reduced(x.to(reduce_in).div(ws), call, group, ws).to(call.output.dtype)))
    for other in (torch.float32, torch.bfloat16, torch.float16):
        if other != reduce_in:
            claimed = "no reduce dtype (the gradient's own)" if claim is None else dtype_name(claim)
            out.append((f"reduced in {dtype_name(other)}, where the hook claims {claimed}",
                        _native(arith, x, call, group, other)))
    for wrong in sorted({1 << (ws - 1).bit_length(), ws - 1, ws + 1} - {ws, 0, 1}) if arith.api != "fsdp2" else ():
        out.append((f"divided as for {wrong} ranks ({arith.dividing_as(wrong).describe().split(' ', 1)[1]}), "
                    f"where the group has {ws}",
                    _native(arith.dividing_as(wrong), x, call, group, claim, group_size=ws)))
    if call.sharded:
        for shift in range(1, ws):
            out.append((f"the reduced shard of rank {(rank - shift) % ws}, not this rank's ({rank})",
                        _native(arith, x, call, group, claim, shift=shift)))
        # A hand-rolled reduce-scatter: all-reduce the whole buffer, keep one chunk (summed in the
        # all-reduce's order, which need not be the reduce-scatter's at 3 or more ranks).
        full = _native(arith, x, dataclasses.replace(call, sharded=False), group, claim).chunk(ws)
        for k in range(ws):
            out.append((f"an all-reduce of the whole buffer, then rank {k}'s chunk" + (
                " (native's values, summed in the all-reduce's order, not the reduce-scatter's)" if k == rank else
                f": the reduced shard of rank {k}, not this rank's ({rank})"), full[k]))
    return out


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


def explain(arith: Arithmetic, call: HookCall, previous: Optional[HookCall], group: Any, rank: int) -> List[str]:
    """Every named cause that reproduces ``call.output`` bit for bit (collective: every rank calls it)."""
    candidates = _candidates(arith, call, group, rank)
    out = call.output
    causes = [name for name, value in candidates if _same(out, value)]
    native = candidates[0][1]
    local = _local(call, rank, arith.world_size) if arith.api != "fsdp2_all_reduce" else native
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


def diagnose(ctx: Any, arith: Arithmetic, log: CallLog, step: int) -> List[Finding]:
    """The diagnosis of ``step`` on this rank: one finding per group of calls with the same explanation, of
    kind ``"diagnosis"`` (named causes), ``"diagnosis_wider_dtype"`` (only a reduction in a wider dtype
    than claimed explains it: more accurate than native), ``"no_known_cause"``, or ``"native_result"``
    (every call of this rank equals native's arithmetic: what differs arose after the hook returned).

    Collective: every rank of ``ctx.group`` must call it at the same point.
    Returns a single "cannot diagnose" finding when the ranks recorded
    different numbers of calls (the candidates' collectives would not match).
    """
    import torch.distributed as dist

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
    def context(call: HookCall) -> Tuple[Any, int, Arithmetic]:
        if call.group is None:  # the check's group: a subgroup context keeps the global rank in ctx.rank
            return ctx.group, dist.get_rank(ctx.group), arith
        # FSDP2: the group and op it passed the comm
        return call.group, dist.get_rank(call.group), dataclasses.replace(arith, world_size=call.group.size(),
                                                                           op=call.op)

    # Phase 1, one collective per call: which calls differ from native on any rank. Phase 2 explains at
    # most MAX_DIAGNOSED_CALLS of those (each costs a dozen collectives).
    differs = torch.tensor([0 if _same(c.output, _native_result(context(c)[2], c, context(c)[0])) else 1
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
