"""The bookkeeper classifies each of pytest's reports of a case once, for the case records (JSON, Markdown, grid,
baseline diff) and the per-hook tallies (verdicts, terminal summary), by pytest's rules for skips and xfail.

The reports are pytest's own ``TestReport`` objects, built as pytest builds them for each kind of case.
"""

from __future__ import annotations

import types

import pytest

from conformance.cases import CaseParams
from conformance.reports import report
from conformance.reports.bookkeeper import Bookkeeper, phase_outcome
from conformance.reports.results import Figure, ShortFigure
from conformance.reports.verdict import Status

HOOK = "my_hook"


def _case(variant="default", ws=2):
    return CaseParams(HOOK, variant, ws, model="net", api="ddp", check="parity", variant_field="config")


def _state():
    spec = types.SimpleNamespace(name=HOOK)
    return types.SimpleNamespace(specs=[types.SimpleNamespace(spec=spec)], runner=None)


def _props(case):
    return case.junit_properties()


def _report(nodeid, when, outcome, longrepr=None, props=(), **extra):
    return pytest.TestReport(nodeid, ("test_ddp.py", 1, "x"), {}, outcome, longrepr, when, duration=0.5,
                             user_properties=list(props), **extra)


def _skip(reason):
    return ("test_ddp.py", 1, f"Skipped: {reason}")


class Run:
    """One bookkeeper fed the reports of cases, as the plugin hooks call it."""

    def __init__(self):
        self.keeper = Bookkeeper(_state())

    def case(self, variant, reports, ws=2):
        case = _case(variant, ws)
        nodeid = f"test_ddp.py::test_ddp_parity[{case.id}]"
        item = types.SimpleNamespace(nodeid=nodeid, name=nodeid.split("::")[-1], user_properties=[],
                                     get_closest_marker=lambda name: object(),
                                     callspec=types.SimpleNamespace(params={"case": case}))
        self.keeper.note_report(item, types.SimpleNamespace(when="setup", excinfo=None))
        for make in reports:
            self.keeper.pytest_runtest_logreport(make(nodeid, case))
        self.keeper.pytest_runtest_logfinish(nodeid)
        return self.keeper.records[nodeid]


def passed(nodeid, case):
    return _report(nodeid, "call", "passed", props=_props(case))


def failed(nodeid, case):
    return _report(nodeid, "call", "failed", "hook my_hook does not conform: check=parity",
                   props=_props(case) + [("max_ulp_diff", Figure(3.0)), ("max_abs_diff", Figure(2.5e-07))])


def skipped_at_setup(nodeid, case):
    return _report(nodeid, "setup", "skipped", _skip("no 3 GPUs here"))


def xfailed_at_call(nodeid, case):
    return _report(nodeid, "call", "skipped", _skip("xfail"), props=_props(case),
                   wasxfail="known failure (f#1): why")


def known_failure_not_run(nodeid, case):  # xfail(run=False): skipped at setup, before the test names its hook
    return _report(nodeid, "setup", "skipped", _skip("[NOTRUN] known failure, not run (f#2): hangs"),
                   wasxfail="[NOTRUN] known failure, not run (f#2): hangs")


def not_run(nodeid, case):  # runner.NotRun: a skip of the call, with the not_run property
    return _report(nodeid, "call", "skipped", _skip("NOT RUN: its pool could not start"),
                   props=_props(case) + [("not_run", "its pool could not start")])


def xpassed_strict(nodeid, case):
    return _report(nodeid, "call", "failed", "[XPASS(strict)] known failure (f#3): fixed?", props=_props(case))


def teardown_error(nodeid, case):
    return _report(nodeid, "teardown", "failed", "teardown raised")


@pytest.mark.parametrize("phase, outcome, reason", [
    (passed, "passed", None),
    (failed, "failed", None),
    (skipped_at_setup, "skipped", "no 3 GPUs here"),
    (xfailed_at_call, "xfailed", "known failure (f#1): why"),
    (known_failure_not_run, "xfailed", "[NOTRUN] known failure, not run (f#2): hangs"),
    (not_run, "skipped", "NOT RUN: its pool could not start"),
    (xpassed_strict, "xpassed", "known failure (f#3): fixed?"),
    (teardown_error, "error", None),
])
def test_each_report_is_classified_by_pytests_rules(phase, outcome, reason):
    assert phase_outcome(phase("test_ddp.py::t[my_hook-default-net-ws2]", _case())) == (outcome, reason)


def test_records_and_tallies_of_each_kind_of_case():
    run = Run()
    setup_ok = lambda nodeid, case: _report(nodeid, "setup", "passed")  # noqa: E731
    teardown_ok = lambda nodeid, case: _report(nodeid, "teardown", "passed")  # noqa: E731
    recs = {
        "passed": run.case("default", [setup_ok, passed, teardown_ok]),
        "failed": run.case("no_sync", [setup_ok, failed, teardown_ok]),
        "skipped": run.case("static_graph", [skipped_at_setup, teardown_ok], ws=3),
        "xfailed": run.case("bucket_view", [setup_ok, xfailed_at_call, teardown_ok]),
        "known_not_run": run.case("small_buckets", [known_failure_not_run, teardown_ok]),
        "not_run": run.case("default", [setup_ok, not_run, teardown_ok], ws=4),
    }
    got = {k: (r.outcome, r.skip_reason, r.known_failure_reason) for k, r in recs.items()}
    assert got == {"passed": ("passed", None, None), "failed": ("failed", None, None),
                   "skipped": ("skipped", "no 3 GPUs here", None),
                   "xfailed": ("xfailed", None, "known failure (f#1): why"),
                   "known_not_run": ("xfailed", None, "[NOTRUN] known failure, not run (f#2): hangs"),
                   "not_run": ("skipped", "NOT RUN: its pool could not start", None)}
    assert recs["failed"].figures == {"max_ulp_diff": 3.0, "max_abs_diff": 2.5e-07}
    assert all(type(v) is float for v in recs["failed"].figures.values())  # floats, not the JUnit text
    assert recs["failed"].failure["message"] == "hook my_hook does not conform: check=parity"
    assert recs["skipped"].world_size == 3 and recs["skipped"].check is None  # from the case: no properties
    assert len(run.keeper.finished_records()) == 6 and recs["skipped"].check == "parity"  # its test's other cases
    assert recs["passed"].duration_s == 1.5  # setup, call and teardown

    tally = run.keeper.tally(HOOK)
    assert dict(tally.counts) == {"passed": 1, "failed": 1, "skipped": 2, "xfailed": 2}
    assert tally.failed_checks == {"parity"}
    assert tally.known_failure_reasons == {"known failure (f#1): why", "[NOTRUN] known failure, not run (f#2): hangs"}
    assert tally.skip_reasons == {"no 3 GPUs here": 1}  # only skips before the test ran, as the terminal lists
    assert tally.not_run == {"its pool could not start"}
    assert tally.ran_at == {2} and dict(run.keeper.tests_at) == {2: {"test_ddp_parity"}}
    assert run.keeper.cases_run == 0  # none was collected in this session
    verdict = report.hook_verdict(tally.counts, tally.failed_checks, tally.ran_at, not_run=sorted(tally.not_run))
    assert (verdict.status, verdict.text) == (Status.DOES_NOT_CONFORM, "DOES NOT CONFORM (parity)")


def test_a_teardown_error_makes_the_record_an_error_but_not_the_hooks_tally():
    run = Run()
    rec = run.case("default", [passed, teardown_error])
    assert rec.outcome == "error" and rec.failure["message"] == "teardown raised"
    assert dict(run.keeper.tally(HOOK).counts) == {"passed": 1}


def test_a_strict_known_failure_that_passed_is_listed():
    run = Run()
    rec = run.case("default", [xpassed_strict])
    assert (rec.outcome, rec.known_failure_reason) == ("xpassed", "known failure (f#3): fixed?")
    assert run.keeper.xpassed == [rec.id] and dict(run.keeper.tally(HOOK).counts) == {"xpassed": 1}


def test_a_case_cut_off_before_it_finished_is_not_listed():
    run = Run()
    case = _case()
    nodeid = f"test_ddp.py::test_ddp_parity[{case.id}]"
    item = types.SimpleNamespace(nodeid=nodeid, name=nodeid, user_properties=[], get_closest_marker=lambda n: 1,
                                 callspec=types.SimpleNamespace(params={"case": case}))
    run.keeper.note_report(item, types.SimpleNamespace(when="setup", excinfo=None))
    run.keeper.pytest_runtest_logreport(_report(nodeid, "setup", "passed"))
    assert nodeid in run.keeper.records and run.keeper.finished_records() == []


def test_figures_are_floats_whose_junit_text_is_todays():
    assert (str(Figure(2.0)), str(Figure(2.384185791015625e-07)), str(Figure(float("inf")))) == \
        ("2", "2.384185791015625e-07", "inf")
    assert (str(ShortFigure(0.0028679)), str(ShortFigure(float("inf")))) == ("2.868e-03", "inf")
    assert ShortFigure(0.0028679) == 0.0028679 and report.figure(0.0028679) == "2.868e-03"
