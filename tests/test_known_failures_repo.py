"""Tests of the repository's own known-failures file, ``fixtures/known_failures.toml``, checked against the
built-in hooks and the case ids the suite generates: every entry has a reason and a hook, matches only its
hook's cases, excuses a long run with its parity cases, never excuses a reference hook, and is named by its
repository path."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance import cases
from conformance.apis.fsdp import builtin_hooks as builtin_fsdp
from conformance.controller.known_failures import KnownFailure, KnownFailureBook, load_known_failures
from conformance.shared.spec_loading import load_specs
from tests.known_failures_helpers import CPU, CUDA_BUILD_ON_CPU
from tests.meta_helpers import plan_settings, planned_test_names

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def repo_entries():
    return load_known_failures(str(REPO / "fixtures" / "known_failures.toml"))


def test_repo_file_entries_have_a_reason_and_a_hook(repo_entries):
    assert repo_entries
    for e in repo_entries:
        assert e.reason.strip(), e.source
        assert e.hook, e.source


def test_repo_file_is_about_builtin_hooks_and_matches_their_cases(repo_entries):
    specs = {s.name: s for s in builtin_fsdp.FSDP_HOOKS}
    builtin = {item.spec.name for item in load_specs([], builtins=True, entry_points=False)}
    for e in repo_entries:
        assert e.hook in builtin, e.source
        if e.hook not in specs:
            continue  # DDP and FSDP2 entries are checked by tests/test_meta_ddp.py and friends
        nightly = plan_settings(depth="nightly")  # the nightly's combined cases too
        names = planned_test_names([specs[e.hook]]) + planned_test_names([specs[e.hook]], nightly)
        for pattern in e.test:
            single = KnownFailure(test=pattern, reason=e.reason, source=e.source)
            assert any(single.matches(n) for n in names), (e.source, pattern)
            # ...and only the cases of the hook it is about.
            other = next(s for s in builtin_fsdp.FSDP_HOOKS if s.name != e.hook)
            others = planned_test_names([other]) + planned_test_names([other], nightly)
            assert not any(single.matches(n) for n in others), (e.source, pattern)


#: Each API's short parity test and its long run: the long run trains the parity case's default config for
#: more steps, so a hook whose every parity case fails the same way fails its long run too.
PARITY_AND_LONG_RUN = (("test_parity", "test_long_run"), ("test_ddp_parity", "test_ddp_long_run"),
                       ("test_fsdp2_parity", "test_fsdp2_long_run"),
                       ("test_fsdp2_replica_parity", "test_fsdp2_replica_long_run"),
                       ("test_fsdp2_all_gather_parity", "test_fsdp2_all_gather_long_run"))


#: Each API's long run and its combined case: the combined case is that long run on a larger probe, so an entry that
#: excuses every long run of a hook excuses its combined case too (the nightly of 2026-12-02 failed the fp16
#: compress wrapper's combined case, and left FSDP1's compress hooks NOT RUN, until their entries said so).
LONG_RUN_AND_SWITCHES = (("test_long_run", "test_switches"), ("test_ddp_long_run", "test_ddp_switches"),
                         ("test_fsdp2_long_run", "test_fsdp2_switches"),
                         ("test_fsdp2_replica_long_run", "test_fsdp2_replica_switches"),
                         ("test_fsdp2_all_gather_long_run", "test_fsdp2_all_gather_switches"),
                         ("test_fsdp2_all_reduce_long_run", "test_fsdp2_all_reduce_switches"))


def test_repo_file_entry_that_excuses_every_long_run_excuses_the_combined_case_too(repo_entries):
    for e in repo_entries:
        for long_run, switches in LONG_RUN_AND_SWITCHES:
            if e.matches(f"{long_run}[{e.hook}-default-net_flat-ws2]") and \
                    e.matches(f"{long_run}[{e.hook}-default-nested_wrapped-ws2]"):
                assert e.matches(f"{switches}[{e.hook}-default-switch_probe_1m-300steps-2nodes-ws2]"), \
                    (e.source, switches)


def test_repo_file_entry_that_excuses_every_parity_case_excuses_the_long_run_too(repo_entries):
    # On a CUDA build of torch 2.11 (the GPU machine, 2026-11-27) the bf16 compress wrapper's long run failed
    # with the recorded violation its entry excuses for parity: the entry had left the long run out.
    for e in repo_entries:
        for parity, long_run in PARITY_AND_LONG_RUN:
            if f"{parity}[{e.hook}-*]" in e.test:
                assert e.matches(f"{long_run}[{e.hook}-default-nested_wrapped-ws2]"), (e.source, long_run)


def test_repo_file_excuses_the_compress_hooks_on_cpu_but_never_the_reference_hooks(repo_entries):
    book = KnownFailureBook(repo_entries, CPU)
    fsdp_names = {s.name for s in builtin_fsdp.FSDP_HOOKS}
    for e in repo_entries:
        if e.applies(CPU) and e.hook in fsdp_names:
            name = "test_parity[" + cases.case_id(e.hook, "FULL_SHARD", model="net_wrapped", world_size=2) + "]"
            assert book.lookup(name) is e
    # allreduce_hook and reduce_scatter_hook define "conforming": nothing may excuse them.
    for spec in builtin_fsdp.FSDP_HOOKS:
        if spec.reduce_dtype is None:
            for name in planned_test_names([spec], plan_settings(2, 3)) + planned_test_names([spec], plan_settings(3, 2)):
                assert book.lookup(name) is None, name


def test_the_packaged_file_is_named_by_its_repository_path(repo_entries):
    assert all(e.source.startswith("fixtures/known_failures.toml#failure[") for e in repo_entries)


def test_repo_file_bf16_refusal_applies_to_cpu_builds_only(repo_entries):
    name = "test_ddp_parity[ddp_bf16_compress_hook-default-nested_wrapped-ws2]"
    assert KnownFailureBook(repo_entries, CPU).lookup(name) is not None
    # a CUDA build accepts the hook even without a GPU, and the hook conforms there
    assert KnownFailureBook(repo_entries, CUDA_BUILD_ON_CPU).lookup(name) is None
    contract = "test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-default-net_flat-ws2]"
    assert KnownFailureBook(repo_entries, CUDA_BUILD_ON_CPU).lookup(contract) is not None
