"""The attribution table (:func:`conformance.controller.attribution.attribute`), one row per rule.

Each row gives a case's facts and its runs so far (plain outcomes and findings, no process) and asserts whose
failure it is, the rule that decided, the reason's key words and the replay it needs next. A last test walks a
case through its replays as the runner does, asking again after each.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest

from conformance.controller.attribution import (Blame, CaseFacts, Replay, Rule, Run, attribute, crash_signatures,
                                                own_exit)
from conformance.protocol import (LOST_CONTROLLER_EXIT_CODE, REFERENCE_DIGEST, CaseResult, CheckResult, Finding,
                                  FindingKind, RankOutcome)

HOOKED = "step 0: forward/backward of the hooked model"
REFERENCE = "step 0: forward/backward of the reference model"
FACTS = CaseFacts(check="fsdp.parity", hook="mine", what="check=parity model=m", replays_reference=True,
                  replays_default_hook=True, default_hook="allreduce_hook", torch_version="2.13.0",
                  params={"strategy": "NO_SHARD"})
AFTER_RETURN = (Finding(0, "gradient differs", step=0, fqn="w", kind="mismatch"),
                Finding(0, "the hook's own result equals native's", step=0, kind="native_result"))


def ok(rank, *found):
    return RankOutcome(rank=rank, ok=True, value=CheckResult(findings=list(found)))


def died(rank, code, phase=HOOKED):
    return RankOutcome(rank=rank, exit_code=code, phase=phase, output="bye\n")


def raised(rank, phase=HOOKED, line="RuntimeError: boom"):
    return RankOutcome(rank=rank, error=f"Traceback (most recent call last):\n{line}\n", error_type="RuntimeError",
                       phase=phase)


def hung(rank, phase=HOOKED):
    return RankOutcome(rank=rank, stack="Thread 0x1 (most recent call first):", phase=phase)


def result(*outcomes, rebuilt=None, leaks=()):
    outcomes = tuple(dataclasses.replace(o, leaks=list(leaks)) if i == 0 and leaks else o
                     for i, o in enumerate(outcomes))
    dead = any(o.exit_code is not None for o in outcomes)
    return CaseResult(case=None, world_size=len(outcomes), outcomes=outcomes,
                      pool_rebuilt=dead if rebuilt is None else rebuilt)


def run(*outcomes, replay=Replay.NONE, found=(), **kw):
    return Run(replay, result(*outcomes, **kw), tuple(found))


def findings_run(*found):
    return run(ok(0), ok(1), found=found)


def not_started(replay, why="no ranks"):
    return Run(replay, None, not_started=why)


def reference(replay, *digests):
    """A reference-only run (``replay``) whose ranks' trained references have ``digests``."""
    return Run(replay, result(*(RankOutcome(rank=i, ok=True, value=CheckResult(figures={REFERENCE_DIGEST: d}))
                                for i, d in enumerate(digests))))


#: Native trained twice, the same bits both times.
NATIVE_KEPT = [reference(Replay.REFERENCE, "a0", "a1"), reference(Replay.REFERENCE_AGAIN, "a0", "a1")]


NOT_CALLED = Finding(0, "FSDP2 never calls the hook under replicate", kind="hook_not_called")
CHANGED = Finding(0, "PyTorch changed: the setter recursed", kind="torch_rule_broken")
SUITES = Finding(1, "the suite's registration missed a group", kind="suite_rule_broken")
DIAGNOSED = Finding(0, "explained by: SUM without averaging", step=0, kind="diagnosis")


#: (id, facts, runs, blame, rule, key words of the reason, next replay)
ROWS = [
    ("signal death: re-run in fresh ranks", FACTS, [run(ok(0), died(1, -signal.SIGKILL))], None,
     Rule.DEATH_BY_SIGNAL, ["died with exit code -9", "signal"], Replay.CRASH_RERUN),
    ("abort: re-run in fresh ranks", FACTS, [run(ok(0), died(1, -signal.SIGABRT))], None,
     Rule.DEATH_BY_SIGNAL, ["exit code -6"], Replay.CRASH_RERUN),
    ("lost torchrun rank: re-run", FACTS, [run(ok(0), RankOutcome(rank=1, lost="lost its connection"), rebuilt=True)],
     None, Rule.DEATH_BY_SIGNAL, ["lost its connection"], Replay.CRASH_RERUN),
    ("the lifeline's exit is the suite's: re-run", FACTS, [run(ok(0), died(1, LOST_CONTROLLER_EXIT_CODE))], None,
     Rule.DEATH_BY_SIGNAL, ["exit code 75"], Replay.CRASH_RERUN),
    ("own exit: no re-run, the default hook's replay", FACTS, [run(ok(0), died(1, 3))], None,
     Rule.OWN_EXIT, ["rank 1 ended its own process, exit status 3", "not run again"], Replay.DEFAULT_HOOK),
    ("own exit, no default hook: the hook's", dataclasses.replace(FACTS, default_hook=None),
     [run(ok(0), died(1, 0))], Blame.HOOK, Rule.OWN_EXIT, ["exit status 0"], Replay.NONE),
    ("own exit, the default hook runs: the hook's", FACTS,
     [run(ok(0), died(1, 3)), run(ok(0), ok(1), replay=Replay.DEFAULT_HOOK)], Blame.HOOK, Rule.CRASH_OF_THE_HOOK,
     ["ended its own process", "runs it to the end", "this hook's doing"], Replay.NONE),
    ("re-run spent: a signal death goes to the default hook", dataclasses.replace(FACTS, rerun_spent=True),
     [run(ok(0), died(1, -9))], None, Rule.CRASH, ["raised, hung or died"], Replay.DEFAULT_HOOK),
    ("re-run could not start: the first run stands", FACTS,
     [run(ok(0), died(1, -9)), not_started(Replay.CRASH_RERUN)], None, Rule.CRASH, ["raised, hung or died"],
     Replay.DEFAULT_HOOK),
    ("re-run ran to the end: it is the case's", FACTS,
     [run(ok(0), died(1, -9)), run(ok(0), ok(1), replay=Replay.CRASH_RERUN)], Blame.NOBODY, Rule.CONFORMS, [],
     Replay.NONE),
    ("rank problems and leaks: the hook's", FACTS, [run(ok(0), raised(1), rebuilt=True, leaks=["a global"])],
     Blame.HOOK, Rule.RANK_PROBLEMS_AND_LEAKS, [], Replay.NONE),
    ("raised in the reference: replay it alone", FACTS, [run(raised(0, REFERENCE), raised(1, REFERENCE))], None,
     Rule.REFERENCE_FAILED, ["suite's reference"], Replay.REFERENCE),
    ("the reference fails alone too: PyTorch's", FACTS,
     [run(raised(0, REFERENCE), raised(1, REFERENCE)), run(raised(0, REFERENCE), ok(1), replay=Replay.REFERENCE)],
     Blame.PYTORCH, Rule.REFERENCE_FAILS_ALONE,
     ["the suite's reference (check=parity model=m, no hook under test) cannot run here with torch 2.13.0",
      "RuntimeError: boom"], Replay.NONE),
    ("the reference runs alone: the hook's", FACTS,
     [run(raised(0, REFERENCE), raised(1, REFERENCE)), run(ok(0), ok(1), replay=Replay.REFERENCE)],
     Blame.HOOK, Rule.REFERENCE_RUNS_ALONE, ["the reference trained alone, with no hook, runs here"], Replay.NONE),
    ("hung in the reference on every rank: replay it alone", FACTS,
     [run(hung(0, REFERENCE), hung(1, REFERENCE), rebuilt=True)], None, Rule.REFERENCE_FAILED,
     ["a rank hung inside the suite's reference"], Replay.REFERENCE),
    ("raised and hung in the reference: replay it alone", FACTS,
     [run(raised(0, REFERENCE), hung(1, REFERENCE), rebuilt=True)], None, Rule.REFERENCE_FAILED,
     ["suite's reference"], Replay.REFERENCE),
    ("the reference hangs alone too: PyTorch's, a skip", FACTS,
     [run(hung(0, REFERENCE), hung(1, REFERENCE), rebuilt=True),
      run(hung(0, REFERENCE), ok(1), replay=Replay.REFERENCE, rebuilt=True)], Blame.PYTORCH,
     Rule.REFERENCE_FAILS_ALONE, ["cannot run here with torch 2.13.0", f"rank 0 hung during {REFERENCE!r}"],
     Replay.NONE),
    ("hung in the reference, runs alone: the hook's", FACTS,
     [run(hung(0, REFERENCE), hung(1, REFERENCE), rebuilt=True), run(ok(0), ok(1), replay=Replay.REFERENCE)],
     Blame.HOOK, Rule.REFERENCE_RUNS_ALONE, ["runs here"], Replay.NONE),
    ("PyTorch's own hook, the reference hung once: the machine's", dataclasses.replace(FACTS, is_default_hook=True),
     [run(hung(0, REFERENCE), hung(1, REFERENCE), rebuilt=True), run(ok(0), ok(1), replay=Replay.REFERENCE)],
     Blame.MACHINE, Rule.CRASH_OF_THE_DEFAULT_HOOK, ["the hook under test", "hung", "not the hook's"], Replay.NONE),
    ("hung, one rank in the hooked model: the default hook's replay", FACTS,
     [run(hung(0, REFERENCE), hung(1), rebuilt=True)], None, Rule.CRASH, ["raised, hung or died"],
     Replay.DEFAULT_HOOK),
    ("a known failure is never replayed", dataclasses.replace(FACTS, known_failure=True),
     [run(ok(0), died(1, -9))], Blame.HOOK, Rule.CRASH_NOT_REPLAYED, [], Replay.NONE),
    ("a crash of the default hook itself: the machine's", dataclasses.replace(FACTS, is_default_hook=True),
     [run(raised(0), ok(1))], Blame.MACHINE, Rule.CRASH_OF_THE_DEFAULT_HOOK,
     ["allreduce_hook, the hook under test", "raised RuntimeError: boom", "not the hook's"], Replay.NONE),
    ("a hook's crash: the default hook's replay", FACTS, [run(hung(0), ok(1), rebuilt=True)], None, Rule.CRASH,
     ["raised, hung or died"], Replay.DEFAULT_HOOK),
    ("the default hook crashes the same way: the machine's", FACTS,
     [run(raised(0), ok(1)), run(raised(0), ok(1), replay=Replay.DEFAULT_HOOK)], Blame.MACHINE, Rule.CRASH_SHARED,
     ["fails it the same way", "torch 2.13.0", "not the hook's"], Replay.NONE),
    ("the default hook crashes otherwise: the hook's", FACTS,
     [run(raised(0), ok(1)), run(hung(1, "step 3"), ok(0), replay=Replay.DEFAULT_HOOK, rebuilt=True)], Blame.HOOK,
     Rule.CRASH_OF_THE_HOOK, ["fails it otherwise (a rank hung during 'step 3')"], Replay.NONE),
    ("the default hook could not start: the hook's, saying so", FACTS,
     [run(raised(0), ok(1)), not_started(Replay.DEFAULT_HOOK, "pool gone")], Blame.HOOK,
     Rule.CRASH_REPLAY_NOT_STARTED, ["could not be replayed: pool gone"], Replay.NONE),
    ("never called: not applicable", FACTS, [findings_run(NOT_CALLED, dataclasses.replace(NOT_CALLED, rank=1))],
     Blame.NOT_APPLICABLE, Rule.NEVER_CALLED, ["the hook was never called", "under replicate"], Replay.NONE),
    ("a rule of PyTorch's: PyTorch's", FACTS, [findings_run(CHANGED, dataclasses.replace(CHANGED, rank=1))],
     Blame.PYTORCH, Rule.PYTORCH_RULE, ["PyTorch changed: the setter recursed"], Replay.NONE),
    ("a rule the suite relies on: the suite's", FACTS, [findings_run(CHANGED, SUITES)], Blame.SUITE, Rule.SUITE_RULE,
     ["the suite's other checks rely on", "registration missed a group"], Replay.NONE),
    ("the hook's own finding beside PyTorch's: the hook's", dataclasses.replace(FACTS, replays_default_hook=False),
     [findings_run(CHANGED, DIAGNOSED)], Blame.HOOK, Rule.FINDINGS, [], Replay.NONE),
    ("a named cause of the hook's own: never replayed", FACTS, [findings_run(*AFTER_RETURN, DIAGNOSED)], Blame.HOOK,
     Rule.FINDINGS, [], Replay.NONE),
    ("the default hook itself, exact until it returned: PyTorch's", dataclasses.replace(FACTS, is_default_hook=True),
     [findings_run(*AFTER_RETURN), *NATIVE_KEPT], Blame.PYTORCH, Rule.DEFAULT_HOOK_ITSELF,
     ["allreduce_hook is PyTorch's own default hook", "no hook can pass this case here"], Replay.NONE),
    ("findings that could be native's own: native trained once", FACTS, [findings_run(*AFTER_RETURN)], None,
     Rule.NATIVE_TWICE, ["is native itself bit-reproducible here?"], Replay.REFERENCE),
    ("findings that could be native's own: native trained twice", FACTS,
     [findings_run(*AFTER_RETURN), NATIVE_KEPT[0]], None, Rule.NATIVE_TWICE, ["bit-reproducible"],
     Replay.REFERENCE_AGAIN),
    ("native gives other bits when trained again: the machine's", FACTS,
     [findings_run(*AFTER_RETURN), reference(Replay.REFERENCE, "a0", "a1"),
      reference(Replay.REFERENCE_AGAIN, "a0", "b1")], Blame.MACHINE, Rule.NATIVE_NOT_REPRODUCIBLE,
     ["native is not bit-reproducible here", "(check=parity model=m, no hook under test)", "other bits on rank 1;",
      "docs/limitations.md"], Replay.NONE),
    ("native's replay could not run: no evidence, the default hook's replay next", FACTS,
     [findings_run(*AFTER_RETURN), NATIVE_KEPT[0], not_started(Replay.REFERENCE_AGAIN)], None,
     Rule.DEFAULT_HOOK_DIFFERS, ["could be PyTorch's"], Replay.DEFAULT_HOOK),
    ("native kept its bits: the default hook's replay", FACTS, [findings_run(*AFTER_RETURN), *NATIVE_KEPT], None,
     Rule.DEFAULT_HOOK_DIFFERS, ["could be PyTorch's"], Replay.DEFAULT_HOOK),
    ("no reference to replay, no default hook: the hook's", dataclasses.replace(FACTS, replays_reference=False,
                                                                               replays_default_hook=False),
     [findings_run(*AFTER_RETURN)], Blame.HOOK, Rule.FINDINGS, [], Replay.NONE),
    ("the default hook shows the same difference: PyTorch's", FACTS,
     [findings_run(*AFTER_RETURN), *NATIVE_KEPT, run(ok(0), ok(1), replay=Replay.DEFAULT_HOOK, found=AFTER_RETURN)],
     Blame.PYTORCH,
     Rule.DEFAULT_HOOK_SAME, ["PyTorch's own default hook (allreduce_hook), replayed on this case, shows the same"],
     Replay.NONE),
    ("the default hook conforms: the hook's", FACTS,
     [findings_run(*AFTER_RETURN), *NATIVE_KEPT, run(ok(0), ok(1), replay=Replay.DEFAULT_HOOK)], Blame.HOOK,
     Rule.DEFAULT_HOOK_NOT_SAME, ["allreduce_hook, replayed on this case, conforms"], Replay.NONE),
    ("the default hook cannot run it: proves nothing", FACTS,
     [findings_run(*AFTER_RETURN), *NATIVE_KEPT, not_started(Replay.DEFAULT_HOOK)], Blame.HOOK,
     Rule.DEFAULT_HOOK_NOT_SAME,
     ["could not run this case here, so it proves nothing"], Replay.NONE),
    ("findings: the hook's", dataclasses.replace(FACTS, default_hook=None), [findings_run(*AFTER_RETURN), *NATIVE_KEPT],
     Blame.HOOK, Rule.FINDINGS, [], Replay.NONE),
    ("nothing found: nobody's", FACTS, [findings_run()], Blame.NOBODY, Rule.CONFORMS, [], Replay.NONE),
]


@pytest.mark.parametrize("facts, runs, blame, rule, words, replay", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_each_row_of_the_attribution(facts, runs, blame, rule, words, replay):
    got = attribute(facts, runs)
    assert (got.blame, got.rule, got.next) == (blame, rule, replay), got
    assert got.final == (replay is Replay.NONE)
    for word in words:
        assert word in got.reason, (word, got.reason)


def test_the_table_covers_every_rule():
    """Every :class:`Rule` is some row's outcome (the caveat's, which needs a real mismatch, has its test below)."""
    covered = {r[4] for r in ROWS}
    assert set(Rule) - covered == {Rule.REFERENCE_CAVEAT}


def test_a_caveat_of_this_torch_skips_without_a_replay():
    """torch 2.4's set-ordered clip norm: 1 ULP after the hook returned is PyTorch's, with no replay."""
    from conformance.shared.compare import Mismatch

    mismatch = Mismatch(reason="values", actual_dtype="float32", expected_dtype="float32", actual_shape=(1,),
                        expected_shape=(1,), actual_device="cpu", expected_device="cpu", numel=1, num_different=1,
                        first_index=(0,), actual_bits="0x4178ca20", expected_bits="0x4178ca21", max_ulp_diff=1.0)
    facts = dataclasses.replace(FACTS, check="fsdp.clip_grad_norm", torch_version="2.4.1",
                                params={"strategy": "FULL_SHARD"})
    got = attribute(facts, [findings_run(dataclasses.replace(AFTER_RETURN[0], mismatch=mismatch), AFTER_RETURN[1])])
    assert (got.blame, got.rule, got.next) == (Blame.PYTORCH, Rule.REFERENCE_CAVEAT, Replay.NONE)
    assert "the reference does not hold on torch 2.4.1" in got.reason and "pytorch/pytorch#134673" in got.reason


def test_own_exit_reads_exit_statuses_of_the_process_s_own_making_only():
    assert own_exit(result(ok(0), died(1, 3))).rank == 1
    assert own_exit(result(ok(0), died(1, 0))).rank == 1
    assert own_exit(result(ok(0), died(1, -signal.SIGSEGV))) is None
    assert own_exit(result(ok(0), died(1, LOST_CONTROLLER_EXIT_CODE))) is None
    assert own_exit(result(ok(0), raised(1))) is None


def test_crash_signatures_blank_addresses_and_tell_the_ways_apart():
    a = result(raised(0, line="RuntimeError: at 0x7f00dead"), hung(1))
    b = result(raised(0, line="RuntimeError: at 0x7f00beef"), died(1, -6))
    assert crash_signatures(a) & crash_signatures(b) == {("raised", HOOKED, "RuntimeError", "RuntimeError: at 0x...")}
    assert ("died", HOOKED, "-6") in crash_signatures(b)


def test_a_case_walks_through_its_replays_as_the_runner_asks():
    """A signal death, re-run; the re-run raises; the default hook's replay runs: the hook's, in three asks."""
    runs = [run(ok(0), died(1, -9))]
    answers = {Replay.CRASH_RERUN: run(raised(0), ok(1), replay=Replay.CRASH_RERUN),
               Replay.DEFAULT_HOOK: run(ok(0), ok(1), replay=Replay.DEFAULT_HOOK)}
    asked = []
    got = attribute(FACTS, runs)
    while not got.final:
        asked.append(got.next)
        runs.append(answers[got.next])
        got = attribute(FACTS, runs)
    assert asked == [Replay.CRASH_RERUN, Replay.DEFAULT_HOOK]
    assert (got.blame, got.rule) == (Blame.HOOK, Rule.CRASH_OF_THE_HOOK)


def test_finding_kinds_are_an_enum_that_still_reads_and_writes_as_strings():
    import json
    import pickle

    f = Finding(0, "x", kind="suite_rule_broken")
    assert f.kind is FindingKind.SUITE_RULE_BROKEN and f.kind == "suite_rule_broken" and f"{f.kind}" == "suite_rule_broken"
    assert json.dumps({"kind": f.kind}) == '{"kind": "suite_rule_broken"}'
    assert pickle.loads(pickle.dumps(f)).kind is FindingKind.SUITE_RULE_BROKEN
    with pytest.raises(ValueError):
        Finding(0, "x", kind="suites")


def test_a_case_needs_its_first_run():
    with pytest.raises(ValueError):
        attribute(FACTS, [])
    with pytest.raises(ValueError):
        attribute(FACTS, [not_started(Replay.NONE)])


def test_an_own_exit_in_the_re_run_is_the_second_runs_failure_not_a_first_exit():
    """A signal death, then rank 1 exits 3 in the fresh ranks: the default hook's replay decides, as for any failed
    re-run, and the reason does not claim the case was not run again."""
    runs = [run(ok(0), died(1, -9)), run(ok(0), died(1, 3), replay=Replay.CRASH_RERUN)]
    got = attribute(FACTS, runs)
    assert (got.blame, got.rule, got.next) == (None, Rule.CRASH, Replay.DEFAULT_HOOK)
    got = attribute(FACTS, [*runs, run(ok(0), ok(1), replay=Replay.DEFAULT_HOOK)])
    assert (got.blame, got.rule) == (Blame.HOOK, Rule.CRASH_OF_THE_HOOK) and "not run again" not in got.reason
