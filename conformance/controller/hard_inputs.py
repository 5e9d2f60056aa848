"""Hard gradient inputs: the named examples, the hypothesis strategy, and one case on the controller.

Gradients are drawn per rank (so ranks differ) from a mix that stresses a
reduction: values near the reduce dtype's overflow threshold (where FSDP's
pre-divide decides between a finite sum and ``inf``), zeros of both signs,
subnormals of the reduce dtype, NaN, +/-Inf, and ordinary values. Each rank's
ordinary values have their own magnitude (:data:`RANK_MAGNITUDES`): in real
data-parallel batches one rank's gradients can be 10**6 times another's, and a
hook that decides anything from its own rank's values alone (a scale, a
rescue from underflow) decides differently there. They are float32 tensors
(the parameters' dtype); the native path casts them to the reduce dtype itself.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hypothesis import HealthCheck, Phase, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from conformance.controller.failures import ConformanceFailure
from conformance.controller.reach import note_reach
from conformance.models import get_model

Shapes = Sequence[Tuple[int, ...]]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: float32 subnormals (the parameter dtype's): the smallest one and one near the normal range.
FLOAT32_SUBNORMALS = [float(torch.tensor(2.0 ** -149)), float(torch.tensor(-(2.0 ** -130)))]


def special_values(reduce_dtype: Optional[torch.dtype]) -> Dict[str, List[float]]:
    """Named groups of hard values for a claim's reduce dtype (``None``: float32).

    All values are representable in float32, the parameter dtype.
    """
    dtype = reduce_dtype or torch.float32
    info = torch.finfo(dtype)
    big = float(info.max)
    near_max = [0.75 * big, -0.75 * big, 0.55 * big, big, -big]
    subnormal = float(info.smallest_normal) / 2 ** (info.bits // 4)
    return {
        "near_overflow": [float(torch.tensor(v, dtype=torch.float32)) for v in near_max],
        "zero": [0.0, -0.0],
        "subnormal": [float(info.smallest_normal), subnormal, -subnormal] + FLOAT32_SUBNORMALS,
        "nonfinite": [float("nan"), float("inf"), float("-inf")],
    }


def _tensor(values: Sequence[float], shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32).reshape(shape)


class Drawn:
    """One generated example: ``grads[rank][i]`` (float32 tensors) for the probe's parameters.

    Its ``repr`` (what hypothesis prints as the falsifying example) lists only
    the elements that are not ``0.0``, by rank, parameter FQN and index, so a
    shrunk example reads as "rank 0: leaves.1.weight[3] = inf".
    """

    def __init__(self, values: Sequence[Sequence[Sequence[float]]], shapes: Shapes, names: Sequence[str]):
        self.values = values
        self.shapes = list(shapes)
        self.names = list(names)

    def grads(self) -> List[List[torch.Tensor]]:
        return [[_tensor(v, s) for v, s in zip(rank, self.shapes)] for rank in self.values]

    def __repr__(self) -> str:
        parts = []
        for r, rank in enumerate(self.values):
            for name, vs in zip(self.names, rank):
                parts += [f"rank {r}: {name}[{k}] = {v!r}" for k, v in enumerate(vs)
                          if not (v == 0.0 and math.copysign(1.0, v) > 0)]
        shown = "; ".join(parts[:12]) + (f"; ... ({len(parts)} in all)" if len(parts) > 12 else "")
        return f"<every element 0.0 except: {shown or 'none'}>"


#: The magnitudes of the ranks' ordinary values, rank ``r`` taking ``RANK_MAGNITUDES[r % 4]``: six orders of
#: magnitude apart at 2 ranks, nine at 4. Every ordinary value times any of them stays a normal number in
#: float16 and bfloat16 but for rank 1's, which fall below float16's normal range (as small gradients do).
RANK_MAGNITUDES = (1.0, 1e-6, 1e3, 1e-3)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (the dtype the gradients are built in)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def hard_gradients(world_size: int, shapes: Shapes, names: Sequence[str],
                   reduce_dtype: Optional[torch.dtype]) -> st.SearchStrategy:
    """Per-rank probe gradients, drawn element by element (a :class:`Drawn`).

    Each element is ``0.0`` (what shrinking moves towards), one of the hard
    values of :func:`special_values` for the claim's reduce dtype, or an
    ordinary float32 in [-4, 4] times its rank's magnitude (one of
    :data:`RANK_MAGNITUDES`, drawn per rank, shrinking towards 1); so a failure
    shrinks to the few elements, on the few ranks, that still make the hook
    differ from the reference.
    """
    specials = [v for vs in special_values(reduce_dtype).values() for v in vs]

    def one_rank(magnitude: float) -> st.SearchStrategy:
        ordinary = st.floats(-4.0, 4.0, width=32, allow_subnormal=False)
        if magnitude != 1.0:
            ordinary = ordinary.map(lambda v: _float32(v * magnitude))
        element = st.one_of(st.just(0.0), st.sampled_from(specials), ordinary)
        return st.tuples(*[st.lists(element, min_size=_numel(s), max_size=_numel(s)) for s in shapes])

    rank = st.sampled_from(RANK_MAGNITUDES).flatmap(one_rank)
    return st.lists(rank, min_size=world_size, max_size=world_size).map(
        lambda values: Drawn(values, shapes, names))


def explicit_examples(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> Dict[str, list]:
    """Deterministic hard inputs every hard-input case runs first, by name.

    * ``near_overflow``: every rank at 0.75x the reduce dtype's max; the sum of
      two such values overflows unless the hook pre-divides as FSDP does.
    * ``zeros``: +0 on rank 0, -0 elsewhere.
    * ``nan_one_rank``: NaN on rank 0 only, ordinary values elsewhere.
    * ``opposite_infinities``: +Inf on rank 0 and -Inf on rank 1 (NaN after the sum).
    * ``subnormals``: the reduce dtype's subnormals and smallest normal.
    * ``float32_subnormals``: subnormals of float32, the parameter dtype.
    """
    groups = special_values(reduce_dtype)
    big = groups["near_overflow"][0]
    tiny = groups["subnormal"]

    def fill(fn) -> list:
        return [[_tensor([fn(r, i, k) for k in range(_numel(s))], s) for i, s in enumerate(shapes)]
                for r in range(world_size)]

    return {name: fill(fn) for name, fn in _patterns(big, tiny).items()}


def _patterns(big: float, tiny: Sequence[float]) -> Dict[str, Callable[[int, int, int], float]]:
    """``pattern(rank, parameter index, element index) -> value`` of each named example."""
    def ordinary(r: int, i: int, k: int) -> float:
        return float((r + 1) * 0.25 + (i + k) * 0.125)

    return {
        "near_overflow": lambda r, i, k: big if (k + r) % 3 else -big,
        "zeros": lambda r, i, k: 0.0 if r == 0 else -0.0,
        "nan_one_rank": lambda r, i, k: float("nan") if r == 0 and k % 2 == 0 else ordinary(r, i, k),
        "opposite_infinities": lambda r, i, k: ((float("inf") if r == 0 else float("-inf") if r == 1
                                                 else ordinary(r, i, k)) if k % 2 == 0 else ordinary(r, i, k)),
        "subnormals": lambda r, i, k: tiny[(r + k) % len(tiny)],
        "float32_subnormals": lambda r, i, k: FLOAT32_SUBNORMALS[(r + k) % 2] * (k % 5 + 1),
    }


#: The most probe elements whose hard inputs are drawn and sent element by element; a probe of production size
#: (``large_probe``, 25 MiB) gets its named patterns placed instead (:func:`placed_examples`).
MAX_DRAWN_ELEMENTS = 4096


#: The label of the packed named example (:func:`named_hard_values`) in failure messages.
NAMED_LABEL = "named hard values"


def named_hard_values(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> list:
    """Every pattern of :func:`explicit_examples` packed into one example, so it costs one step.

    Element ``k`` of parameter ``i`` holds pattern ``(k + i) mod 6`` (in the
    order of :func:`explicit_examples`), at that pattern's own element
    ``k // 6``; so every pattern reaches the large parameters and the small FSDP
    units get different ones. A reduction is elementwise, so packing changes
    nothing for a hook that reduces correctly, and a hook that looks at a whole
    bucket (a NaN check) still sees every pattern. ``grads[rank][i]`` as there.
    """
    groups = special_values(reduce_dtype)
    fns = list(_patterns(groups["near_overflow"][0], groups["subnormal"]).values())
    return [[_tensor([fns[(k + i) % len(fns)](r, i, k // len(fns)) for k in range(_numel(s))], s)
             for i, s in enumerate(shapes)] for r in range(world_size)]


#: The label of the per-rank magnitudes example (:func:`rank_magnitude_values`) in failure messages.
RANK_MAGNITUDES_LABEL = "per-rank magnitudes"


def rank_magnitude_values(world_size: int, shapes: Shapes) -> list:
    """Ordinary values, every rank at its own magnitude (rank ``r`` times ``RANK_MAGNITUDES[r % 4]``), unpacked.

    Not packed into :func:`named_hard_values`: there every bucket of every rank
    holds values near the reduce dtype's overflow, so no rank's values are
    small as a whole. Here rank 1's gradients are 10**6 times smaller than
    rank 0's everywhere. ``grads[rank][i]`` as there.
    """
    def value(r: int, i: int, k: int) -> float:
        ordinary = (r + 1) * 0.25 + (i + k) * 0.125 + (k % 7) / 64.0
        return _float32(ordinary * (1 - 2 * (k % 2)) * RANK_MAGNITUDES[r % len(RANK_MAGNITUDES)])

    return [[_tensor([value(r, i, k) for k in range(_numel(s))], s) for i, s in enumerate(shapes)]
            for r in range(world_size)]


# -- production-sized buffers: the patterns placed where a size-dependent path goes wrong ----------------------


def placed_positions(numel: int, world_size: int) -> List[int]:
    """Where the named patterns go in a buffer of ``numel`` elements split over ``world_size`` ranks: both ends,
    every power-of-two boundary ``2^k - 1, 2^k, 2^k + 1`` (``k >= 4``: where a loop over chunks of 2^k elements
    turns), and both sides of each shard boundary (a multiple of ``ceil(numel / world_size)``); sorted, each once.
    A chunk loop that drops its tail, a padding error or an off-by-one chunk boundary misses one of them."""
    at = {0, 1, 2, numel - 3, numel - 2, numel - 1}
    k = 4
    while 2 ** k + 1 < numel:
        at.update((2 ** k - 1, 2 ** k, 2 ** k + 1))
        k += 1
    shard = -(-numel // world_size)
    for r in range(1, world_size):
        at.update((r * shard - 1, r * shard))
    return sorted(i for i in at if 0 <= i < numel)


def placed_examples(world_size: int, shapes: Shapes, reduce_dtype: Optional[torch.dtype]) -> List[Tuple[str, Any]]:
    """The named examples of a probe of production size (``large_probe``), as descriptions each rank builds
    (:func:`~conformance.shared.standalone_main.placed_tensor`): ordinary values everywhere (uniform in
    [-1, 1), seeded by rank and parameter), then

    * every pattern of :func:`named_hard_values` placed at :func:`placed_positions` (position ``j`` holds
      pattern ``j mod 6`` at that pattern's element ``j // 6``, as packed there);
    * the ranks at their own magnitudes (:data:`RANK_MAGNITUDES`), nothing placed.
    """
    groups = special_values(reduce_dtype)
    fns = list(_patterns(groups["near_overflow"][0], groups["subnormal"]).values())

    def placed(r: int, i: int, shape: Tuple[int, ...], scale: float, at: Sequence[int]) -> Dict[str, Any]:
        return {"shape": tuple(shape), "seed": 7919 * (r + 1) + i, "scale": scale, "at": list(at),
                "values": [fns[j % len(fns)](r, i, j // len(fns)) for j in range(len(at))]}

    named = [[placed(r, i, s, 1.0, placed_positions(_numel(s), world_size)) for i, s in enumerate(shapes)]
             for r in range(world_size)]
    magnitudes = [[placed(r, i, s, RANK_MAGNITUDES[r % len(RANK_MAGNITUDES)], ()) for i, s in enumerate(shapes)]
                  for r in range(world_size)]
    return [(PLACED_LABEL, named), (RANK_MAGNITUDES_LABEL, magnitudes)]


#: The label of the placed named example (:func:`placed_examples`) in failure messages.
PLACED_LABEL = "named hard values at the buffer's ends and power-of-two and shard boundaries"


# -- one hard-input case, on the controller ----------------------------------------------------


def probe_layout(model: str = "gradient_probe") -> Tuple[List[Tuple[int, ...]], List[str]]:
    """``(shapes, FQNs)`` of a probe's parameters (``gradient_probe``, ``large_probe``), in
    ``named_parameters()`` order."""
    probe = get_model(model)
    return probe.input_shapes(), [name for name, _ in probe._construct(1).named_parameters()]


def examples_seed(world_size: int, reduce_dtype: Optional[torch.dtype], seed: str = "") -> int:
    """The hypothesis seed of the drawn examples for one world size and reduce dtype: CRC-32 of those and of
    hypothesis's ``--hypothesis-seed`` (if given).

    Not of the case id: every hook (and every variant) with the same world size and reduce dtype meets the
    same drawn examples, so two hooks' hard-input results compare, and a run draws each set once
    (:func:`claim_examples`). ``--hypothesis-seed`` draws other ones.
    """
    return zlib.crc32(f"{world_size}\0{reduce_dtype}\0{seed}".encode())


def _failed_step(exc: Any) -> Optional[int]:
    """The step (example index) of a failure's first finding, or ``None`` (a rank raised, hung or died)."""
    steps = [f.step for f in getattr(exc, "findings", ()) if f.step is not None]
    return min(steps) if steps else None


def _case_settings(examples: int) -> Dict[str, Any]:
    """Hypothesis's settings for one case's ``examples`` draws with values: ``examples + 1`` (hypothesis's first,
    the simplest example, is drawn and never sent: :func:`_all_zero`), no deadline, no example database. The batch
    (:func:`drawn_examples`) and a failing case's search use the same, so the search replays the batch's draws."""
    return dict(max_examples=examples + 1, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


def _all_zero(drawn: Drawn) -> bool:
    """Whether every element is ``+0.0``: the simplest example, where hypothesis starts every search."""
    return all(v == 0.0 and math.copysign(1.0, v) > 0 for rank in drawn.values for vs in rank for v in vs)


def drawn_examples(strategy: st.SearchStrategy, examples: int, seed: int) -> List[Drawn]:
    """The first ``examples`` values ``strategy`` (:func:`hard_gradients`) draws with hypothesis seed ``seed``,
    generated only (no test run, no shrinking): what a hard-input case sends in its first dispatch.

    Hypothesis's first draw is always the simplest example, every element ``+0.0`` (a reduction no hook gets
    wrong that gets the named ``zeros`` right); it is left out, so ``examples`` are drawn after it."""
    out: List[Drawn] = []

    @hypothesis_settings(phases=(Phase.generate,), **_case_settings(examples))
    @hypothesis_seed(seed)
    @given(drawn=strategy)
    def draw(drawn: Drawn) -> None:
        if not _all_zero(drawn):
            out.append(drawn)

    draw()
    return out[:examples]


@functools.lru_cache(maxsize=None)
def claim_examples(world_size: int, reduce_dtype: Optional[torch.dtype], examples: int,
                   seed: str) -> Tuple[Drawn, ...]:
    """The ``examples`` drawn examples of every hard-input case at ``world_size`` ranks with ``reduce_dtype``,
    drawn once per run (:func:`drawn_examples` with :func:`examples_seed`); a case sends ``d.grads()``, fresh
    tensors, so nothing a rank does to them reaches the next case."""
    shapes, names = probe_layout()
    strategy = hard_gradients(world_size, shapes, names, reduce_dtype)
    return tuple(drawn_examples(strategy, examples, examples_seed(world_size, reduce_dtype, seed)))


def state_or_input(replay: Callable[[List[Tuple[str, Any]]], None], examples: Sequence[Tuple[str, Any]],
                   step: int) -> Optional[str]:
    """A case that failed at ``step`` > 0 (its examples feed one step each, to one hook that lives through them):
    was the example the trigger, or the hook's state after ``step`` steps? ``replay(batch)`` feeds ``batch`` to a
    fresh hook. The failing example goes alone, at the hook's step 0; where that matches native, it goes again
    after the case's first example, at step 1, where the API has taken its steady shape (DDP rebuilds its
    buckets after the first step, so a bucket-size path first shows there). Where both match, the words that
    say the hook's own state is the trigger (a warm-up, a counter, a cache); else ``None``: the input is."""
    failing = examples[step]
    # At step 1, [examples[0], failing] is the case itself: only the replay at step 0 tells anything.
    for batch in ([failing], [examples[0], failing])[:1 if step == 1 else 2]:
        try:
            replay(batch)
        except ConformanceFailure:
            return None
    if step == 1:
        return (f"state or input: the {failing[0]!r} example that differs at step 1 matches native when fed to a "
                "fresh hook at its step 0, where the API may not have taken its steady shape yet (DDP rebuilds its "
                "buckets after the first step); after one step, the hook's state or the API's is the trigger, not "
                "these values alone")
    return (f"state, not input: the {failing[0]!r} example that differs at step {step} matches native when fed "
            f"to a fresh hook at its step 0 and at step 1, after the first example; what triggers the difference "
            f"is the hook's state after {step} step(s) of this case (a warm-up that ends, a counter, a cached or "
            "reused buffer), not these values. The long run (check long_run) follows such a hook step by step")


def with_note(exc: ConformanceFailure, note: str) -> ConformanceFailure:
    """``exc`` with ``note`` (one paragraph) above its re-run command, its findings kept."""
    text, sep, rerun = str(exc).partition("\nRe-run just this case:")
    return ConformanceFailure(f"{text}\n  {note}{sep}{rerun}", exc.findings, exc.rank_problems)


def check_case(conform: Any, request: Any, case: Any, check: str, rank_check: str, params: Dict[str, Any]) -> None:
    """Run one hard-input case: the named examples (packed, :func:`named_hard_values`, and the ranks at their own
    magnitudes, :func:`rank_magnitude_values`), then ``--hypothesis-examples``
    drawn by hypothesis (:func:`hard_gradients`), one dispatch each; a failure is shrunk to a minimal example.

    The ranks keep the case's probes between dispatches
    (:func:`conformance.ranks.checks.probe.run_examples`), so an example costs one
    forward/backward. Generation is seeded (:func:`examples_seed`), so the re-run
    command draws the same examples. A known failure is not shrunk (its
    cause is known), and after a dispatch that hung or killed a rank nothing
    more is sent: that example is the one reported.

    Raises:
        ConformanceFailure: with the findings of the first differing example;
            for a generated one, shrunk, with its elements listed.
    """
    __tracebackhide__ = True
    reduce_dtype = conform.specs[case.hook].spec.reduce_dtype
    examples, seed = conform.settings.hypothesis_examples, conform.settings.hypothesis_seed
    describe = conform.tag(request, case, check)
    name = request.node.name
    shapes, names = probe_layout(params.get("model") or "gradient_probe")

    def dispatch(batch: List[Tuple[str, Any]], fresh: bool) -> None:
        result = conform.run(name, check=rank_check, hook=case.hook, world_size=case.world_size, describe=describe,
                             params={**params, "examples": batch, "case_id": name, "fresh": fresh},
                             known_failure=request.node.get_closest_marker("xfail") is not None, nodes=case.nodes)
        # reached only where the batch passed
        note_reach(request, result, real_nodes=getattr(conform.pools.get(case.world_size), "nodes", None))

    known = request.node.get_closest_marker("xfail") is not None

    def batch(examples_: List[Tuple[str, Any]]) -> Optional[ConformanceFailure]:
        """One dispatch of ``examples_`` on a fresh hook; its failure, or ``None``. A failure at a step after
        the first is checked for state (:func:`state_or_input`), and raised at once where the state is the
        trigger."""
        try:
            dispatch(examples_, fresh=True)
            return None
        except ConformanceFailure as exc:
            failed_at = _failed_step(exc)
            if failed_at is None or failed_at == 0 or known:
                return exc
            state = state_or_input(lambda replayed: dispatch(replayed, fresh=True), examples_, failed_at)
            if state is not None:
                raise with_note(exc, state) from None
            return exc

    if sum(_numel(s) for s in shapes) > MAX_DRAWN_ELEMENTS:  # production size: placed, built on the ranks
        failure = batch(placed_examples(case.world_size, shapes, reduce_dtype))
        if failure is not None:
            raise failure
        return
    explicit = [(NAMED_LABEL, named_hard_values(case.world_size, shapes, reduce_dtype)),
                (RANK_MAGNITUDES_LABEL, rank_magnitude_values(case.world_size, shapes))]
    if examples <= 0:
        failure = batch(explicit)
        if failure is not None:
            raise failure
        return
    strategy = hard_gradients(case.world_size, shapes, names, reduce_dtype)
    case_settings = _case_settings(examples)
    case_seed = examples_seed(case.world_size, reduce_dtype, seed)
    # The examples drawn without running them (once per run): the same seed draws the same sequence below.
    drawn_first = claim_examples(case.world_size, reduce_dtype, examples, seed)
    # One dispatch for the named and the drawn examples: what a passing case costs.
    batch_failure = batch(explicit + [("generated", d.grads()) for d in drawn_first])
    if batch_failure is None:
        return
    failed_at = _failed_step(batch_failure)
    if failed_at is None or failed_at < len(explicit) or known:
        raise batch_failure  # a named example, a rank that raised or hung, or a known failure: no search
    restarts = conform.restarts

    # A drawn example failed: search again, one example per dispatch, and shrink the failure.
    @hypothesis_settings(phases=(Phase.generate, Phase.shrink), **case_settings)
    @hypothesis_seed(case_seed)
    @given(drawn=strategy)
    def search(drawn: Drawn) -> None:
        if conform.restarts != restarts or _all_zero(drawn):
            return  # a dispatch hung or killed a rank: send nothing more, report that one; or the simplest example
        try:
            dispatch([("generated", drawn.grads())], fresh=False)
        except ConformanceFailure as exc:
            text, sep, rerun = str(exc).partition("\nRe-run just this case:")
            raise ConformanceFailure(f"{text}\n  generated example (hypothesis, seed {case_seed}, "
                                     f"shrunk to the fewest nonzero elements): {drawn!r}{sep}{rerun}") from None

    search()
    raise batch_failure  # not reproduced one example at a time (a hook that keeps state between examples)
