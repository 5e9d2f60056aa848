"""Meta-tests specific to DDP (``register_comm_hook`` on DistributedDataParallel).

They read the DDP zoo's run (``tests/meta_zoos/``: DDP, one run per session, restricted to
the DDP module); the shape every zoo shares (each bad hook caught, each good one passing,
failures that name everything, re-run commands, named causes) is in ``tests/test_meta.py``.
Plus checks, without a run, of the DDP entries of the packaged known-failures file.
"""

from __future__ import annotations

import os

import pytest

from tests.meta_helpers import REPO
from tests.meta_zoos import DDP, NATIVE_MODES
from tests.zoo import ddp_hooks as zoo


@pytest.fixture
def zoo_run(zoo_runs):
    return zoo_runs(DDP)


def _cases(run, hook, check=None):
    return [c for c in run.by_hook()[hook] if check is None or c.check == check]


@pytest.mark.parametrize("name", ["bad_returns_list", "bad_returns_none", "bad_wrong_shape", "bad_wrong_dtype"])
def test_ddp_future_contract_violations_are_findings_not_crashes(zoo_run, name):
    """Every failure of a hook that breaks the future contract names the violation; no rank raised or died."""
    failed = [c for c in _cases(zoo_run, name) if c.outcome == "failed"]
    assert failed
    for case in failed:
        assert "did not finish the case" not in case.message, f"{case.name} crashed:\n{case.message[:3000]}"
    contract = [c for c in failed if c.check == "future_contract"]
    assert contract and all("the hook" in c.message and "bucket 0" in c.message for c in contract)


def test_ddp_none_instead_of_future_is_reported_not_a_segfault(zoo_run):
    for case in _cases(zoo_run, "bad_returns_none"):
        assert "not a torch.futures.Future" in case.message, case.message[:2000]


def test_ddp_list_value_says_take_the_first_element(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_returns_list", "future_contract")]
    assert messages and all("take its first element" in m for m in messages)


def test_ddp_wrong_dtype_names_both_dtypes(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_wrong_dtype", "future_contract")]
    assert messages and all("dtype float16 instead of float32" in m for m in messages)


def test_ddp_bare_registration_names_the_bucket_parameter(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_param_not_named_bucket", "future_contract")]
    assert messages and all("register_comm_hook rejects the hook" in m and "'bucket'" in m for m in messages)


def test_ddp_divide_instead_of_multiply_is_only_caught_at_world_size_three(zoo_run):
    """x / ws and x * (1/ws) agree at 2 ranks: only the non-power-of-two world size tells them apart."""
    cases = _cases(zoo_run, "bad_divides_by_world_size")
    failed = [c for c in cases if c.outcome == "failed"]
    assert failed and all(c.properties.get("world_size") == "3" for c in failed), [c.name for c in failed]
    assert any(c.outcome == "passed" and c.check == "parity" and c.properties.get("world_size") == "2"
               for c in cases)


def test_ddp_stale_data_is_caught_from_the_second_step(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_stale_second_step", "parity") if c.outcome == "failed"]
    findings = [m.split("Diagnosis")[0].split("Re-run")[0] for m in messages]
    assert messages and all("[rank 0, step 1," in f and "step 0" not in f for f in findings)
    assert all("the result of step 0 (stale)" in m for m in messages)


def test_ddp_noop_report_says_it_never_communicates(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_noop_hook", "averaging")]
    assert messages and all("the hook never communicated (no collective was issued on any process group" in m
                            for m in messages)


def test_ddp_hook_that_communicates_but_returns_the_bucket_unreduced_is_told_apart(zoo_run):
    """The climate-model pattern: averaging p.grad, then returning bucket.buffer(): the report says the hook
    communicated and DDP copied the unreduced result over it, and only bucket_view passes."""
    cases = _cases(zoo_run, "bad_averages_param_grads")
    for case in [c for c in cases if c.check in ("averaging", "parity") and c.outcome == "failed"]:
        assert "collective(s), but its result is the local gradient it received" in case.message, case.name
        assert "never communicated" not in case.message, case.name
    passed = {c.properties.get("config") for c in cases if c.check == "parity" and c.outcome == "passed"}
    failed = {c.properties.get("config") for c in cases if c.check == "parity" and c.outcome == "failed"}
    assert passed == {"bucket_view"} and "default" in failed, (passed, failed)


def test_ddp_hook_that_never_communicates_is_not_told_to_declare_itself_lossy(zoo_run):
    """No LossyContract hint for a hook that never communicates. (The hint where nothing explains the
    difference, and its absence where an exact cause does: DDP.causes in tests/meta_zoos/.)"""
    cases = _cases(zoo_run, "bad_noop_hook", "averaging")
    assert cases and all("LossyContract" not in c.message for c in cases)


def test_ddp_observed_error_is_reported_as_a_figure(zoo_run):
    """The lossy-error check attaches the observed maximum as a property, passing or failing."""
    for case in _cases(zoo_run, "good_fp16_lossy_declared", "lossy_error"):
        figure = float(case.properties["observed_rel_error"])
        assert 0 < figure <= zoo.GENEROUS_FP16.rel_error_bound, case.name
    failed = [c for c in _cases(zoo_run, "bad_lossy_exceeds_bound", "lossy_error") if c.outcome == "failed"]
    assert failed
    for case in failed:
        figure = case.properties["observed_rel_error"]
        assert float(figure) > 1e-5
        assert f"observed max relative error {figure}" in case.message
        assert "exceeds the declared rel_error_bound 1.000e-05" in case.message


def test_ddp_introduced_nan_is_named(zoo_run):
    messages = [c.message for c in _cases(zoo_run, "bad_lossy_nan", "lossy_error") if c.outcome == "failed"]
    assert messages and all("introduced NaN/Inf where the exact mean is finite" in m for m in messages)


def test_ddp_loss_margin_reports_both_losses(zoo_run):
    (case,) = _cases(zoo_run, "bad_lossy_diverges", "lossy_loss")
    assert case.outcome == "failed"
    assert float(case.properties["observed_loss_rel_diff"]) > 0.01
    assert "with the hook" in case.message and "declared loss_margin 1.000e-02" in case.message


# -- the DDP entries of the packaged known-failures file (no suite run) ----------------------

def _ddp_entries():
    from conformance.apis.ddp.builtin_hooks import DDP_HOOKS
    from conformance.controller.known_failures import load_known_failures

    names = {s.name for s in DDP_HOOKS}
    entries = load_known_failures(os.path.join(REPO, "fixtures", "known_failures.toml"))
    return [e for e in entries if e.hook in names], DDP_HOOKS


def _ddp_test_names(specs):
    from tests.meta_helpers import planned_test_names

    return planned_test_names(specs)


def test_ddp_known_failure_entries_match_only_their_hooks_cases():
    """Every pattern of a DDP entry matches some case of its hook and no case of another hook."""
    from conformance.controller.known_failures import KnownFailure

    entries, specs = _ddp_entries()
    assert entries
    for e in entries:
        spec = next(s for s in specs if s.name == e.hook)
        mine = _ddp_test_names([spec])
        others = _ddp_test_names([s for s in specs if s.name != e.hook])
        matched = False
        for pattern in e.test:
            single = KnownFailure(test=pattern, reason=e.reason, source=e.source)
            matched = matched or any(single.matches(n) for n in mine)
            assert not any(single.matches(n) for n in others), (e.source, pattern)
        assert matched, e.source


def test_ddp_reference_hook_is_only_excused_where_division_differs():
    """allreduce_hook defines nothing here: its one excuse (x / 3 where DDP multiplies by 1/3) stays at the
    exact comparisons, parity and hard inputs, at world size 3."""
    from conformance.controller.known_failures import KnownFailureBook, RunEnvironment

    entries, specs = _ddp_entries()
    spec = next(s for s in specs if s.name == "ddp_allreduce_hook")
    for env in (RunEnvironment("gloo", "cpu", "2.13.0+cpu"), RunEnvironment("nccl", "cuda", "2.13.0")):
        book = KnownFailureBook(entries, env)
        excused = [n for n in _ddp_test_names([spec]) if book.lookup(n) is not None]
        assert excused and all(n.startswith(("test_ddp_parity[", "test_ddp_hard_inputs[")) and n.endswith("-ws3]")
                               for n in excused), excused


def test_ddp_not_run_entries_are_gloo_only():
    """Cases reported without running (deadlocks, rank crashes) are excused on gloo only."""
    entries, _ = _ddp_entries()
    not_run = [e for e in entries if not e.run]
    assert not_run and all(e.backend == "gloo" for e in not_run)


def test_ddp_generated_failure_is_shrunk_to_its_minimal_example(zoo_run):
    """Only a generated example catches this hook; hypothesis shrinks it to one +Inf off rank 0."""
    failed = [c for c in _cases(zoo_run, "bad_saturates_inf_off_rank0", "hard_inputs") if c.outcome == "failed"]
    assert failed
    for case in failed:
        text = case.message
        assert "generated example (hypothesis, seed " in text, text[:3000]
        listing = text.split("shrunk to the fewest nonzero elements): <every element 0.0 except: ", 1)[1]
        listing = listing.split(">", 1)[0]
        elements = listing.split("; ")
        assert len(elements) == 1 and elements[0].endswith("= inf") and not elements[0].startswith("rank 0"), \
            listing
        assert "Re-run just this case:" in text


def test_ddp_one_story_per_hook_under_its_grid(zoo_run):
    """A bug that parity and hard inputs see differently is stated once, under the hook's grid: the cause that
    explains the most failed cases, with how many."""
    failed = _failed(zoo_run, "bad_fp16_cast_back_then_divide")
    line = next((ln for ln in zoo_run.output.splitlines() if ln.strip().startswith("most failures explained by: SUM in "
                                                                                     "float16, cast back to float32")),
                None)
    assert line is not None, zoo_run.output[-3000:]
    assert f"({len(failed)} of {len(failed)} failed cases" in line, (line, len(failed))


#: The bad DDP hooks that claim exactness and whose failures may offer the LossyContract hint: a lossy design
#: that did not declare itself (its zoo entry says so). No other bad hook's failure may carry it.
UNDECLARED_LOSSY = {"bad_lossy_undeclared"}


def test_ddp_no_bad_hook_is_told_to_declare_itself_lossy_unless_it_is_lossy_by_design(zoo_run):
    hinted = {c.hook for c in zoo_run.cases if c.outcome == "failed" and "LossyContract" in c.message}
    exact_bad = {s.name for s in zoo.KNOWN_BAD if s.lossy is None}
    assert hinted & exact_bad == UNDECLARED_LOSSY, sorted(hinted & exact_bad)


def _failed(run, hook):
    return [c for c in run.by_hook()[hook] if c.outcome == "failed"]


def test_a_hook_meant_for_one_native_is_checked_against_it_and_its_other_natives_cases_say_why(zoo_runs):
    """DDP's two natives (issue 45): a hook meant for the batched copy alone passes every parity case, each config
    trained with batched_grad_copy=True (its default cases in the batched_grad_copy config); a hook that names no
    native is held to the default one, and its batched_grad_copy cases say how to be checked there too. (A
    skipped case's JUnit entry has no properties: its id names the hook and the config.)"""
    run = zoo_runs(NATIVE_MODES)

    def cases(hook, outcome):
        return [c.name for c in run.cases if c.name.startswith(f"test_ddp_parity[{hook}-") and c.outcome == outcome]

    def messages(hook):
        return [c.message for c in run.cases if c.name.startswith(f"test_ddp_parity[{hook}-")
                and c.outcome == "skipped"]

    batched = "good_divides_batched_native"
    passed = cases(batched, "passed")
    assert {f"test_ddp_parity[{batched}-batched_grad_copy-nested_wrapped-ws{n}]" for n in (2, 3)} <= set(passed)
    assert {f"test_ddp_parity[{batched}-{c}" for c in ("static_graph-net_flat-ws2]", "no_sync-net_flat-ws2]",
                                                       "find_unused-unused_param-ws2]")} <= set(passed), passed
    assert not cases(batched, "skipped") and not cases(batched, "failed")
    assert not any("-default-" in name for name in passed)
    default = "good_reciprocal_default_native"
    assert sorted(cases(default, "skipped")) == [f"test_ddp_parity[{default}-batched_grad_copy-nested_wrapped-ws{n}]"
                                                  for n in (2, 3)]
    assert all("native_modes=('default', 'batched_grad_copy')" in m for m in messages(default))
    assert f"test_ddp_parity[{default}-default-nested_wrapped-ws3]" in cases(default, "passed")
