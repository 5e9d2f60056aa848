"""Who is to blame for a case: one pure function over the case's runs.

:func:`attribute` reads what a case did (the first run, then each replay it asked for, as :class:`Run` values)
and the facts of the case (:class:`CaseFacts`), and returns an :class:`Attribution`: who is to blame
(:class:`Blame`), why (its reason, the text the case ends with), which rule of the table below decided
(:class:`Rule`) and the replay it needs next (:class:`Replay`; :attr:`Replay.NONE` once it is final). The runner
(:meth:`conformance.controller.runner.Runner.run`) runs the replay asked for, appends its run, and asks again; it
runs nothing else, and acts on the final attribution: the hook's fails the case, PyTorch's and "not applicable"
skip it, the suite's and the machine's make it ``NOT RUN``, nobody's passes it.

The rules, in the order they are read (each a :class:`Rule`):

1. A rank that ended its own process during a case of a hook (an exit status of its own: ``sys.exit`` where
   it ends the process, ``os._exit``) did so in the hook's code: the hook's doing, not run again
   (:attr:`Rule.OWN_EXIT`). A rank killed by a signal (the machine's out-of-memory kill, a C++ abort's
   ``SIGABRT``, ``SIGSEGV``) or lost (torchrun's, exit status unknown) may have died of something from before
   the case: the case runs once more in fresh ranks (:attr:`Rule.DEATH_BY_SIGNAL`), once per hook, and the
   second run is the case's (where no fresh ranks could start, the first stands).
2. Where a rank raised, hung or died in the case's run: what the hook left behind fails it
   (:attr:`Rule.RANK_PROBLEMS_AND_LEAKS`); a failure inside the suite's own reference (every rank that did not
   finish raised or hung there) replays the reference alone (PyTorch's where it fails or hangs there too: a
   skip, as a reference that cannot run here); else a hook's crash is replayed with PyTorch's own default hook
   for the case, and is the machine's where that fails the same way (the ``CRASH_*`` rules).
3. Where every rank finished: findings that hold whatever the hook is are not its failure (the hook never
   called: not applicable; a rule of PyTorch's: PyTorch's; one of the suite's own: the suite's); findings that
   name no cause of the hook's own may be PyTorch's (a reference caveat of this torch) or the machine's: the
   reference is trained alone twice, and where native itself gives other bits from the same seed and inputs
   (a nondeterministic op; on NCCL, an algorithm chosen per run), the case is the machine's
   (:attr:`Rule.NATIVE_NOT_REPRODUCIBLE`), for no hook can be held to bits native does not keep; else
   PyTorch's own default hook showing the same difference makes it PyTorch's (the ``DEFAULT_HOOK_*`` rules);
   other findings are the hook's. A finding that names a cause of the hook's own (its result against native's
   arithmetic on the very inputs it was handed) is the hook's whatever the machine does, and replays nothing.

The module reads plain data only (:mod:`conformance.protocol`'s outcomes and findings): no torch of its own, no
I/O. ``tests/test_attribution.py`` holds one row per rule.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Dict, FrozenSet, Optional, Sequence, Tuple

from conformance.controller import default_replay
from conformance.protocol import (LOST_CONTROLLER_EXIT_CODE, REFERENCE_DIGEST, CaseResult, Finding, FindingKind,
                                  RankOutcome)
from conformance.reports.report import exception_line

__all__ = ["Attribution", "Blame", "CaseFacts", "DECLARE_LOSSY_HINT", "NOT_THE_HOOKS_RULES", "REPRODUCED", "Replay",
           "Rule", "Run", "attribute", "case_run", "crash_signatures", "first_loss", "lossy_hint_fits", "lost_a_rank",
           "own_exit", "reference_digests", "stopped_in_reference"]


class Blame(enum.Enum):
    """Whose failure a case is, and so how it ends."""

    NOBODY = "nobody"  # nothing failed: the case passes
    HOOK = "the hook"  # the case fails
    PYTORCH = "PyTorch"  # PyTorch cannot run the case, or its reference does not hold here: a skip
    SUITE = "the suite"  # a rule the suite's own machinery relies on fails: NOT RUN, the run's failure
    MACHINE = "the machine"  # the machine (or the suite, or this torch) cannot run it, whatever the hook: NOT RUN
    NOT_APPLICABLE = "not applicable"  # the API never called the hook in this case: a skip


class Replay(enum.Enum):
    """A run of the case beside the first, that the attribution asks for."""

    NONE = "none"  # nothing more: the attribution is final
    CRASH_RERUN = "the case again, in fresh ranks"
    REFERENCE = "the suite's reference alone, no hook"  # the case's parameters with ``reference_only=True``
    REFERENCE_AGAIN = "the suite's reference alone, a second time"  # as REFERENCE: native trained twice
    DEFAULT_HOOK = "the case with PyTorch's own default hook in the hook's place, in ranks of its own"


class Rule(enum.Enum):
    """The row of the attribution table that decided (module docstring)."""

    OWN_EXIT = "a rank ended its own process in the hook's case"
    DEATH_BY_SIGNAL = "a rank died by a signal, or was lost"
    RANK_PROBLEMS_AND_LEAKS = "a rank raised, hung or died, and the hook left its process changed"
    REFERENCE_FAILED = "a rank raised or hung inside the suite's reference"
    REFERENCE_FAILS_ALONE = "the reference alone fails too"
    REFERENCE_RUNS_ALONE = "the reference alone runs"
    CRASH_NOT_REPLAYED = "a rank raised, hung or died; nothing to replay it with"
    CRASH_OF_THE_DEFAULT_HOOK = "PyTorch's own default hook, under test, crashed"
    CRASH = "a rank of the hook's case raised, hung or died"
    CRASH_REPLAY_NOT_STARTED = "the default hook's replay could not start"
    CRASH_SHARED = "the default hook fails the case the same way"
    CRASH_OF_THE_HOOK = "the default hook runs the case, or fails it otherwise"
    NEVER_CALLED = "the API never called the hook"
    SUITE_RULE = "a rule the suite relies on fails"
    PYTORCH_RULE = "a rule of PyTorch's fails"
    REFERENCE_CAVEAT = "a reference caveat of this torch explains the difference"
    NATIVE_TWICE = "findings that could be native's own: native trained twice"
    NATIVE_NOT_REPRODUCIBLE = "native trained twice gives other bits"
    DEFAULT_HOOK_ITSELF = "the hook is PyTorch's own default hook, exact until it returned"
    DEFAULT_HOOK_DIFFERS = "findings that could be PyTorch's"
    DEFAULT_HOOK_SAME = "the default hook shows the same difference"
    DEFAULT_HOOK_NOT_SAME = "the default hook does not show the same difference"
    FINDINGS = "the hook's findings"
    CONFORMS = "no finding"


#: Rules of findings that hold whatever the hook is: the case ends before the check's closing note is read.
NOT_THE_HOOKS_RULES = frozenset({Rule.NEVER_CALLED, Rule.SUITE_RULE, Rule.PYTORCH_RULE})

#: Rules after which a failure gets a standalone reproducer (under ``--write-reproducers``).
REPRODUCED = frozenset({Rule.OWN_EXIT, Rule.CRASH_NOT_REPLAYED, Rule.CRASH_REPLAY_NOT_STARTED, Rule.CRASH_OF_THE_HOOK,
                        Rule.FINDINGS, Rule.DEFAULT_HOOK_DIFFERS, Rule.DEFAULT_HOOK_NOT_SAME})


#: Closes the hook's failure of an exactness check (:attr:`CaseFacts.claims_exactness`) where it fits
#: (:func:`lossy_hint_fits`): the hook may be lossy by design, and can say so.
DECLARE_LOSSY_HINT = (
    "If this hook is lossy by design (compression, quantization, low-rank, a reduction more accurate than "
    "native), declare what it promises instead of exactness: "
    "HookSpec(..., lossy=LossyContract(rel_error_bound=..., loss_margin=...)); "
    "the suite then checks the declared error bound against the exact float64 mean, no NaN/Inf introduced, "
    "the training-loss margin and determinism, plus the API's structural rules, instead of bitwise parity"
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a case, as the attribution reads it.

    Attributes:
        replay: which run it is: :attr:`Replay.NONE` for the first, else the replay that asked for it.
        result: every rank's outcome; ``None`` where its ranks could not start.
        findings: what the run found, judged as the case judges them (every rank's findings, across ranks
            where the check compares them, what the hook left in its ranks), where every rank finished.
        not_started: why its ranks could not start (with ``result`` ``None``).
    """

    replay: Replay
    result: Optional[CaseResult]
    findings: Tuple[Finding, ...] = ()
    not_started: str = ""


@dataclasses.dataclass(frozen=True)
class CaseFacts:
    """What the attribution needs to know of a case beside its runs.

    Attributes:
        check: the rank check's registered name.
        hook: the hook's spec name (``None``: a case of no hook).
        what: the case, ``key=value`` words, for reasons (``check=parity model=m``).
        known_failure: an expected failure (xfail): nothing is re-run or replayed, there being no red to avoid.
        rerun_spent: the hook's one re-run in fresh ranks was spent on an earlier case.
        replays_reference: the check can train its reference alone (``REPLAYS_REFERENCE``).
        replays_default_hook: the check can be replayed with PyTorch's default hook (``REPLAYS_DEFAULT_HOOK``).
        default_hook: PyTorch's own default hook for the case (``ControllerSide.default_hook``), ``None``: none.
        is_default_hook: the hook under test is that very built-in hook.
        torch_version: ``torch.__version__``.
        params: the rank check's parameters (a reference caveat reads them).
        claims_exactness: an exactness check of a hook that declares no lossy contract: a failure of its that
            nothing named explains may be a lossy design not declared (:data:`DECLARE_LOSSY_HINT`).
    """

    check: str
    hook: Optional[str]
    what: str = ""
    known_failure: bool = False
    rerun_spent: bool = False
    replays_reference: bool = False
    replays_default_hook: bool = False
    default_hook: Optional[str] = None
    is_default_hook: bool = False
    torch_version: str = ""
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    claims_exactness: bool = False


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Who is to blame, why, and the replay needed before it is final.

    Attributes:
        blame: whose failure it is; ``None`` while :attr:`next` is to run.
        rule: the table's row that decided.
        reason: the skip's or ``NOT RUN``'s reason; for the hook's failure, the note that closes it (``""``: none).
        next: the replay to run and append before asking again (:attr:`Replay.NONE`: final).
        detail: what follows a ``NOT RUN`` reason (a rank's traceback, the other findings).
    """

    blame: Optional[Blame]
    rule: Rule
    reason: str = ""
    next: Replay = Replay.NONE
    detail: str = ""

    @property
    def final(self) -> bool:
        return self.next is Replay.NONE

    @property
    def closes_with_the_checks_note(self) -> bool:
        """Whether the failure text ends with the check's own closing note (a lossy case's observed figures): not
        where the findings hold whatever the hook is (:data:`NOT_THE_HOOKS_RULES`)."""
        return self.rule not in NOT_THE_HOOKS_RULES

    @property
    def reproduced(self) -> bool:
        """Whether the hook's failure gets a standalone reproducer (under ``--write-reproducers``,
        :data:`REPRODUCED`)."""
        return self.rule in REPRODUCED


# -- rank deaths -----------------------------------------------------------------------------------


def _dead(o: RankOutcome) -> bool:
    return not o.ok and (o.exit_code is not None or bool(o.lost))


def lost_a_rank(result: CaseResult) -> bool:
    """Whether a rank of ``result`` died or was lost (not one that raised or hung) and the pool was rebuilt."""
    return result.pool_rebuilt and any(_dead(o) for o in result.outcomes)


def own_exit(result: CaseResult) -> Optional[RankOutcome]:
    """The first rank of ``result`` that ended its own process: an exit status of its own (0 or more, not a
    signal's negative one), other than the suite's (:data:`LOST_CONTROLLER_EXIT_CODE`, a rank whose controller
    is gone). Its code is no signal from the machine: in a case's rank, only the hook's code exits so (the
    rank's own code reports a ``SystemExit`` that reaches it as a raise; PyTorch aborts, by ``SIGABRT``)."""
    return next((o for o in result.outcomes if not o.ok and o.exit_code is not None and o.exit_code >= 0
                 and o.exit_code != LOST_CONTROLLER_EXIT_CODE), None)


def stopped_in_reference(result: CaseResult) -> bool:
    """Whether every rank of ``result`` that did not finish raised or hung (no death: the case timed out, or the
    rank left a stack dump) while building or training the suite's reference model, the native path with no hook
    (the phase it last announced names the reference)."""
    bad = [o for o in result.outcomes if not o.ok]
    return bool(bad) and all("reference" in o.phase and not _dead(o) and
                             (o.error is not None or o.hung or result.timed_out) for o in bad)


def _how_it_failed(o: RankOutcome) -> str:
    """``rank N hung during 'phase'`` or ``rank N raised X during 'phase': <its exception line>``."""
    if o.error is None:
        return f"rank {o.rank} hung during {o.phase!r}"
    return f"rank {o.rank} {o.summary().split(': ', 1)[-1]}: {exception_line(o.error)}"


def first_loss(result: CaseResult) -> Tuple[str, str]:
    """The first dead or lost rank of ``result``: its summary line, and the first line of its output (``""``)."""
    o = next(o for o in result.outcomes if _dead(o))
    return o.summary(), next((line.strip() for line in (o.output or "").splitlines() if line.strip()), "")


def _signature(o: RankOutcome, timed_out: bool) -> Tuple[str, ...]:
    """How one rank did not finish: raised (phase, exception type, its line with addresses blanked), hung
    (phase), died (phase, exit code) or was lost."""
    if o.error is not None:
        line = re.sub(r"0x[0-9a-fA-F]+", "0x...", exception_line(o.error))
        return ("raised", o.phase, o.error_type or "", line)
    if o.stack is not None or timed_out:
        return ("hung", o.phase)
    if o.exit_code is not None:
        return ("died", o.phase, str(o.exit_code))
    return ("lost", o.phase)


def crash_signatures(result: CaseResult) -> FrozenSet[Tuple[str, ...]]:
    """How the ranks of ``result`` that did not finish failed, as a set: two runs of a case failed the same
    way where they share one."""
    return frozenset(_signature(o, result.timed_out) for o in result.outcomes if not o.ok)


def _describe(signature: Tuple[str, ...]) -> str:
    kind, phase, *rest = signature
    if kind == "raised":
        what = f"raised {rest[-1]}"
    elif kind == "died":
        what = f"died (exit code {rest[0]})"
    else:
        what = "hung" if kind == "hung" else "was lost"
    return f"a rank {what} during {phase!r}"


# -- the table -------------------------------------------------------------------------------------


def _final(blame: Blame, rule: Rule, reason: str = "", detail: str = "") -> Attribution:
    return Attribution(blame, rule, reason, Replay.NONE, detail)


def _ask(replay: Replay, rule: Rule, reason: str) -> Attribution:
    return Attribution(None, rule, reason, replay)


def case_run(runs: Sequence[Run]) -> Run:
    """The run whose outcome is the case's: the re-run in fresh ranks where one started, else the first."""
    rerun = next((r for r in runs if r.replay is Replay.CRASH_RERUN and r.result is not None), None)
    return rerun or runs[0]


def _replay(runs: Sequence[Run], replay: Replay) -> Optional[Run]:
    return next((r for r in runs if r.replay is replay), None)


def attribute(facts: CaseFacts, runs: Sequence[Run]) -> Attribution:
    """Who is to blame for the case ``facts`` whose runs so far are ``runs`` (the first, then each replay asked
    for, in order), and the replay it needs next (module docstring: the table).

    Raises:
        ValueError: ``runs`` is empty, or its first run did not start (the runner ends such a case first).
    """
    if not runs or runs[0].result is None:
        raise ValueError("a case's attribution needs its first run")
    first = runs[0].result
    if lost_a_rank(first) and not facts.known_failure and not facts.rerun_spent:
        mine = own_exit(first) if facts.hook is not None else None
        if mine is None and _replay(runs, Replay.CRASH_RERUN) is None:
            return _ask(Replay.CRASH_RERUN, Rule.DEATH_BY_SIGNAL,
                        f"{first_loss(first)[0]}: a death by a signal may come from before the case")
    run = case_run(runs)
    assert run.result is not None
    if not run.result.all_ok:
        return _rank_problems(facts, runs, run.result)
    return _findings(facts, runs, list(run.findings))


def _rank_problems(facts: CaseFacts, runs: Sequence[Run], result: CaseResult) -> Attribution:
    """Rules 1 and 2: a rank of the case's run raised, hung or died."""
    # an own exit in a re-run is told by the re-run's note (the rank problems), as any second run's failure
    mine = own_exit(result) if facts.hook is not None and result is runs[0].result else None
    if stopped_in_reference(result) and facts.replays_reference:
        hung = any(o.error is None for o in result.outcomes if not o.ok)
        alone = _replay(runs, Replay.REFERENCE)
        if alone is None:
            return _ask(Replay.REFERENCE, Rule.REFERENCE_FAILED,
                        f"a rank {'hung' if hung else 'failed'} inside the suite's reference")
        if alone.result is None:
            return _final(Blame.HOOK, Rule.REFERENCE_RUNS_ALONE,
                          f"(the reference alone could not be replayed: {alone.not_started})")
        bad = [o for o in alone.result.outcomes if not o.ok]
        if bad:
            return _final(Blame.PYTORCH, Rule.REFERENCE_FAILS_ALONE,
                          f"the suite's reference ({facts.what}, no hook under test) cannot run here with torch "
                          f"{facts.torch_version}: {_how_it_failed(bad[0])}")
        if not (hung and facts.is_default_hook):  # PyTorch's own hook beside a reference that hung once: below
            return _final(Blame.HOOK, Rule.REFERENCE_RUNS_ALONE,
                          "(the reference trained alone, with no hook, runs here: the failure above comes from "
                          "training it beside the hooked model)")
    if result.leak_findings():
        return _final(Blame.HOOK, Rule.RANK_PROBLEMS_AND_LEAKS, _own_exit_note(mine) if mine is not None else "")
    if facts.hook is None or facts.known_failure or facts.default_hook is None:
        rule = Rule.OWN_EXIT if mine is not None else Rule.CRASH_NOT_REPLAYED
        return _final(Blame.HOOK, rule, _own_exit_note(mine) if mine is not None else "")
    name, shapes = facts.default_hook, crash_signatures(result)
    whose = f"the run's failure (this machine's, the suite's or torch {facts.torch_version}'s), not the hook's"
    if facts.is_default_hook:
        return _final(Blame.MACHINE, Rule.CRASH_OF_THE_DEFAULT_HOOK,
                      f"PyTorch's own default hook for this case ({name}, the hook under test) cannot run it here: "
                      f"{_describe(min(shapes))}; {whose}")
    replayed = _replay(runs, Replay.DEFAULT_HOOK)
    if replayed is None:
        return _ask(Replay.DEFAULT_HOOK, Rule.OWN_EXIT if mine is not None else Rule.CRASH,
                    _own_exit_note(mine) if mine is not None else "a rank of the hook's case raised, hung or died")
    lead = (_own_exit_note(mine) + "\n") if mine is not None else ""
    if replayed.result is None:
        return _final(Blame.HOOK, Rule.CRASH_REPLAY_NOT_STARTED,
                      f"{lead}(PyTorch's own default hook for this case, {name}, could not be replayed: "
                      f"{replayed.not_started})")
    theirs = crash_signatures(replayed.result)
    same = shapes & theirs
    if same:
        return _final(Blame.MACHINE, Rule.CRASH_SHARED,
                      f"PyTorch's own default hook for this case ({name}), replayed in ranks of its own, fails it "
                      f"the same way: {_describe(min(same))}; {whose}")
    how = "runs it to the end" if not theirs else f"fails it otherwise ({_describe(min(theirs))})"
    return _final(Blame.HOOK, Rule.CRASH_OF_THE_HOOK,
                  f"{lead}(PyTorch's own default hook for this case, {name}, replayed in ranks of its own, {how}: "
                  "what failed above is this hook's doing)")


def _own_exit_note(o: RankOutcome) -> str:
    return (f"(rank {o.rank} ended its own process, exit status {o.exit_code}, in the hook's case: an exit of the "
            "process's own making is the hook's doing, so the case was not run again in fresh ranks; only a "
            "death by a signal is)")


def lossy_hint_fits(found: Sequence[Finding]) -> bool:
    """Whether the hook's failure of an exactness check with findings ``found`` may be a lossy design: something
    differs in what it computed (not only what it left in its ranks, :attr:`FindingKind.left_behind`), nothing
    rules a lossy design out (:attr:`FindingKind.rules_out_a_lossy_design`: it never communicated, or broke its
    API's contract) and no diagnosis names a bug (:attr:`FindingKind.names_a_bug`: a wrong divisor, a stale step,
    a neighbour's shard, each reproducing its result bit for bit)."""
    computed = [f for f in found if not f.kind.left_behind]
    return bool(computed) and not any(f.kind.rules_out_a_lossy_design or f.kind.names_a_bug for f in computed)


def _findings(facts: CaseFacts, runs: Sequence[Run], found: Sequence[Finding]) -> Attribution:
    """Rule 3: every rank of the case's run finished; ``found`` is what it found. A failure of the hook's closes
    with :data:`DECLARE_LOSSY_HINT` where the case claims exactness and the hint fits (:func:`lossy_hint_fits`)."""
    decided = _weigh(facts, runs, found)
    if decided.blame is not Blame.HOOK or not facts.claims_exactness or not lossy_hint_fits(found):
        return decided
    hint = "  " + DECLARE_LOSSY_HINT
    return dataclasses.replace(decided, reason=f"{hint}\n{decided.reason}" if decided.reason else hint)


def _weigh(facts: CaseFacts, runs: Sequence[Run], found: Sequence[Finding]) -> Attribution:
    """Rule 3, who is to blame: the rows of findings, native trained twice and PyTorch's default hook."""
    if found and all(f.kind == FindingKind.HOOK_NOT_CALLED for f in found):
        return _final(Blame.NOT_APPLICABLE, Rule.NEVER_CALLED,
                      f"ran, and matched, but the hook was never called: {found[0].message}")
    if found and all(f.kind in (FindingKind.TORCH_RULE_BROKEN, FindingKind.SUITE_RULE_BROKEN) for f in found):
        said = list(dict.fromkeys(f.message for f in found))  # every rank says the same: once each
        suites = [f.message for f in found if f.kind == FindingKind.SUITE_RULE_BROKEN]
        if suites:
            return _final(Blame.SUITE, Rule.SUITE_RULE,
                          f"a rule that holds whatever the hook is, and that the suite's other checks rely on, "
                          f"fails here: {suites[0]}", detail="\n".join(m for m in said if m != suites[0]))
        return _final(Blame.PYTORCH, Rule.PYTORCH_RULE, " ".join(said))
    if not found:
        return _final(Blame.NOBODY, Rule.CONFORMS)
    if not (default_replay.could_be_pytorchs(found) and not facts.known_failure):
        return _final(Blame.HOOK, Rule.FINDINGS)
    version = facts.torch_version
    caveat = default_replay.caveat_for(facts.check, facts.params, found, version) if facts.replays_default_hook \
        else None
    if caveat is not None:
        return _final(Blame.PYTORCH, Rule.REFERENCE_CAVEAT, default_replay.caveat_reason(caveat, found, version))
    native = _native_twice(facts, runs) if facts.replays_reference else None
    if native is not None:
        return native
    name, returned = facts.default_hook, default_replay.after_the_hook_returned(found)
    if name is None or not facts.replays_default_hook:
        return _final(Blame.HOOK, Rule.FINDINGS)
    if facts.is_default_hook:  # the evidence is this very failure
        if returned:
            return _final(Blame.PYTORCH, Rule.DEFAULT_HOOK_ITSELF,
                          default_replay.default_hook_reason(name, found, version, itself=True))
        return _final(Blame.HOOK, Rule.FINDINGS)
    replayed = _replay(runs, Replay.DEFAULT_HOOK)
    if replayed is None:
        return _ask(Replay.DEFAULT_HOOK, Rule.DEFAULT_HOOK_DIFFERS,
                    "no finding names a cause of the hook's own: the difference could be PyTorch's")
    all_ok = replayed.result is not None and replayed.result.all_ok
    theirs = list(replayed.findings) if all_ok else []
    if all_ok and default_replay.same_difference(found, theirs):
        return _final(Blame.PYTORCH, Rule.DEFAULT_HOOK_SAME,
                      default_replay.default_hook_reason(name, found, version, itself=False))
    note = "  " + default_replay.default_hook_note(name, theirs, all_ok) if returned else ""
    return _final(Blame.HOOK, Rule.DEFAULT_HOOK_NOT_SAME, note)


def reference_digests(run: Run) -> Optional[Tuple[Optional[str], ...]]:
    """Each rank's digest of its trained reference in a reference-only run (:data:`REFERENCE_DIGEST`), or ``None``
    where the run did not start or a rank of it did not finish."""
    if run.result is None or not run.result.all_ok:
        return None
    return tuple(getattr(o.value, "figures", {}).get(REFERENCE_DIGEST) for o in run.result.outcomes)


def _native_twice(facts: CaseFacts, runs: Sequence[Run]) -> Optional[Attribution]:
    """Native against itself, before a finding that names no cause of the hook's own is blamed on anyone: the
    reference trained alone twice on the case's ranks (:attr:`Replay.REFERENCE`, :attr:`Replay.REFERENCE_AGAIN`).
    The machine's where their digests differ on a rank; ``None`` (no evidence: the next rules decide) where they
    agree, or a replay did not run to the end."""
    once, again = _replay(runs, Replay.REFERENCE), _replay(runs, Replay.REFERENCE_AGAIN)
    if once is None or again is None:
        return _ask(Replay.REFERENCE if once is None else Replay.REFERENCE_AGAIN, Rule.NATIVE_TWICE,
                    "no finding names a cause of the hook's own: is native itself bit-reproducible here?")
    first, second = reference_digests(once), reference_digests(again)
    if first is None or second is None or first == second:
        return None
    ranks = [i for i, (a, b) in enumerate(zip(first, second)) if a != b]
    return _final(Blame.MACHINE, Rule.NATIVE_NOT_REPRODUCIBLE,
                  f"native is not bit-reproducible here: the suite's reference ({facts.what}, no hook under test), "
                  f"trained alone twice on the case's ranks from the same seed and inputs, ends with other bits on "
                  f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}; no hook can be held to bits "
                  "that native itself does not keep on this machine, so the case is not judged (an op or a "
                  "collective whose result depends on more than its inputs; on NCCL, the algorithm, protocol or "
                  "channel count it picks: docs/limitations.md, 'Native that is not bit-reproducible')")
