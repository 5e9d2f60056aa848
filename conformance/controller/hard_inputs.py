"""One hard-input case on the controller: the named examples, then the drawn ones, in one dispatch; a failure
searched again one example at a time and shrunk by hypothesis.

What the examples hold (the hard values, the strategy that draws them, the patterns placed in a production-sized
buffer) is :mod:`conformance.controller.hard_examples`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from hypothesis import HealthCheck, Phase, given
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from conformance.controller.failures import ConformanceFailure
from conformance.controller.hard_examples import (MAX_DRAWN_ELEMENTS, NAMED_LABEL, RANK_MAGNITUDES_LABEL, Drawn,
                                                  hard_gradients, named_hard_values, placed_examples,
                                                  rank_magnitude_values)
from conformance.reports.reach import note_reach
from conformance.models import get_model

if TYPE_CHECKING:  # pragma: no cover
    import pytest

    from conformance.cases import CaseParams
    from conformance.controller.runner import Runner

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


def _failed_step(exc: ConformanceFailure) -> Optional[int]:
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


@contextlib.contextmanager
def source_constants_off() -> Iterator[None]:
    """Hypothesis's draws from a seed, whatever modules this process has loaded.

    Hypothesis (6.131 on) mixes into its draws, about one in twenty, literals it reads from the source of every
    module it finds loaded from outside site-packages and the standard library (its ``_get_local_constants``,
    in ``hypothesis.internal.conjecture.providers``): the suite itself run from a checkout, a user's hook
    modules, whatever the run has imported so far. The same seed then draws other examples once a module loads,
    mid-run (a failure's first diagnosis, say), or in the re-run command's process, which loads fewer: a search
    would not replay the batch's draws, and a re-run would not send the examples that failed. Inside this
    context hypothesis sees no such module (its own constants, the same everywhere, stay). Where a hypothesis
    version has no such collection, this does nothing.
    """
    try:
        from hypothesis.internal.conjecture import providers
        collect, cache, none = providers._get_local_constants, providers.CONSTANTS_CACHE.cache, providers.Constants()
    except (ImportError, AttributeError, TypeError):  # a hypothesis without it (or with another shape of it)
        yield
        return
    providers._get_local_constants = lambda: none
    cache.clear()  # the permitted constants of each kind of draw, computed with the modules' literals
    try:
        yield
    finally:
        providers._get_local_constants = collect
        cache.clear()


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

    with source_constants_off():
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


def check_case(conform: Runner, request: pytest.FixtureRequest, case: CaseParams, check: str, rank_check: str,
               params: Dict[str, Any]) -> None:
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

    def dispatch(batch: List[Tuple[str, Any]], fresh: bool, reproduce: bool = True) -> None:
        result = conform.run(name, check=rank_check, hook=case.hook, world_size=case.world_size, describe=describe,
                             params={**params, "examples": batch, "case_id": name, "fresh": fresh},
                             known_failure=request.node.get_closest_marker("xfail") is not None, nodes=case.nodes,
                             reproduce=reproduce)
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

    if sum(math.prod(s) for s in shapes) > MAX_DRAWN_ELEMENTS:  # production size: placed, built on the ranks
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

    def shrunk(exc: ConformanceFailure, drawn: Drawn) -> ConformanceFailure:
        text, sep, rerun = str(exc).partition("\nRe-run just this case:")
        return ConformanceFailure(f"{text}\n  generated example (hypothesis, seed {case_seed}, "
                                  f"shrunk to the fewest nonzero elements): {drawn!r}{sep}{rerun}")

    # A drawn example failed: search again, one example per dispatch, and shrink the failure. Each example that
    # fails while hypothesis shrinks is attributed as any case is, but writes no reproducer: the smallest one does,
    # once the search ends (what hypothesis raises is that example's failure).
    smallest: List[Drawn] = []

    @hypothesis_settings(phases=(Phase.generate, Phase.shrink), **case_settings)
    @hypothesis_seed(case_seed)
    @given(drawn=strategy)
    def search(drawn: Drawn) -> None:
        if conform.restarts != restarts or _all_zero(drawn):
            return  # a dispatch hung or killed a rank: send nothing more, report that one; or the simplest example
        try:
            dispatch([("generated", drawn.grads())], fresh=False, reproduce=False)
        except ConformanceFailure as exc:
            smallest[:] = [drawn]
            raise shrunk(exc, drawn) from None

    try:
        with source_constants_off():  # as the batch drew (drawn_examples), whatever the dispatches since loaded
            search()
    except ConformanceFailure:
        if smallest and conform.settings.reproducers_dir and conform.restarts == restarts:
            try:  # the smallest example once more, with its reproducer
                dispatch([("generated", smallest[0].grads())], fresh=False)
            except ConformanceFailure as exc:
                raise shrunk(exc, smallest[0]) from None
        raise  # no reproducer wanted, or the example no longer fails on its own (a hook that keeps state)
    raise batch_failure  # not reproduced one example at a time (a hook that keeps state between examples)
