"""Tests for conformance.controller.known_failures' matching and book: a ``test`` pattern (``*`` the only
wildcard, the whole name, a node id by its test name), the conditions an entry applies under (backend, device,
torch version), ``KnownFailureBook``'s lookup and its unused entries, and which known failures a run runs.

The entries are built in this process; reading them from a file is in ``tests/test_known_failures.py``.
"""

from __future__ import annotations

import pytest

from conformance.controller.known_failures import KnownFailure, KnownFailureBook, RunEnvironment
from tests.known_failures_helpers import CPU, CUDA


def entry(test, **kw) -> KnownFailure:
    return KnownFailure(test=test, reason=kw.pop("reason", "because"), source=kw.pop("source", "t#0"), **kw)


# -- patterns ----------------------------------------------------------------------------------


def test_star_matches_any_run_of_characters():
    e = entry("test_parity[a-*]")
    assert e.matches("test_parity[a-FULL_SHARD-net_wrapped-ws2]")
    assert e.matches("test_parity[a-]")
    assert not e.matches("test_parity[b-x]")


def test_brackets_are_literal_not_a_character_class():
    # As a glob, "[a-*]" would be a character class; here it is the text "[a-".
    e = entry("test_parity[a-*]")
    assert not e.matches("test_paritya-x")
    assert not e.matches("test_parityb")
    assert entry("test_x[[]").matches("test_x[[]")
    assert not entry("test_x[ab]").matches("test_xa")


@pytest.mark.parametrize("pattern, other_name", [
    ("test_parity.a", "test_parityXa"),
    ("test_p.rity[a-*]", "test_pXrity[a-1]"),
    ("test_(x|y)", "test_x"),
    ("test_a+", "test_aa"),
    ("test_a$", "test_a"),
])
def test_regex_metacharacters_are_literal(pattern, other_name):
    assert not entry(pattern).matches(other_name)
    assert entry(pattern).matches(pattern.replace("*", "anything"))


def test_pattern_must_match_the_whole_name():
    e = entry("test_parity[a-*")
    assert e.matches("test_parity[a-x]")  # '*' swallows the ']'
    assert not entry("test_parity").matches("test_parity[a-x]")
    assert not entry("parity[a-x]").matches("test_parity[a-x]")


def test_question_mark_is_not_a_wildcard():
    assert not entry("test_parity[a-?]").matches("test_parity[a-x]")
    assert entry("test_parity[a-?]").matches("test_parity[a-?]")


def test_any_pattern_of_a_list_matches():
    e = entry(["test_averaging[h-*]", "test_parity[h-FULL_SHARD-*]"])
    assert e.matches("test_averaging[h-NO_SHARD-ws2]")
    assert e.matches("test_parity[h-FULL_SHARD-net_flat-ws3]")
    assert not e.matches("test_parity[h-NO_SHARD-net_flat-ws3]")


def test_a_single_string_is_one_pattern():
    e = entry("test_parity[h-*]")
    assert e.test == ("test_parity[h-*]",)
    assert e.matches("test_parity[h-x]")
    assert not e.matches("t")  # not split into one-letter patterns


def test_node_id_is_matched_by_its_test_name():
    e = entry("test_parity[h-*]")
    assert e.matches("conformance/suite/test_fsdp.py::test_parity[h-FULL_SHARD-net_wrapped-ws2]")
    assert e.matches("suite/test_fsdp.py::TestFSDP::test_parity[h-NO_SHARD-ws2]")
    assert not e.matches("conformance/suite/test_fsdp.py::test_parity[g-FULL_SHARD-net_wrapped-ws2]")


# -- conditions -----------------------------------------------------------------------------------


def test_no_conditions_apply_everywhere():
    e = entry("x")
    assert e.applies(CPU) and e.applies(CUDA)
    assert e.conditions() == "always"


def test_backend_and_device_conditions():
    assert entry("x", device="cpu").applies(CPU)
    assert not entry("x", device="cpu").applies(CUDA)
    assert entry("x", backend="nccl").applies(CUDA)
    assert not entry("x", backend="nccl").applies(CPU)
    assert not entry("x", backend="gloo", device="cuda").applies(CPU)
    assert "device=cpu" in entry("x", device="cpu").conditions()


@pytest.mark.parametrize("version, applies", [
    ("2.13.0+cpu", True),        # local version labels do not matter
    ("2.13.0", True),
    ("2.4.1", False),            # compared as versions, not as strings ("2.4" > "2.13" as text)
    ("2.14.0a0+git123", True),   # a nightly of the next release is at least 2.13
    ("3.0.0", True),
])
def test_torch_condition_compares_versions(version, applies):
    env = RunEnvironment(backend="gloo", device="cpu", torch_version=version)
    assert entry("x", torch=">=2.13").applies(env) is applies


def test_torch_condition_with_an_upper_bound():
    old = RunEnvironment(backend="gloo", device="cpu", torch_version="2.4.1")
    new = RunEnvironment(backend="gloo", device="cpu", torch_version="2.13.0+cpu")
    e = entry("x", torch="<2.13")
    assert e.applies(old) and not e.applies(new)
    assert entry("x", torch="==2.13.*").applies(new)


# -- the book -------------------------------------------------------------------------------------


def test_lookup_returns_the_first_matching_entry_that_applies():
    cuda_only = entry("test_parity[h-*]", device="cuda", source="f#0")
    broad = entry("test_parity[h-*]", source="f#1")
    narrow = entry("test_parity[h-FULL_SHARD-*]", source="f#2")
    book = KnownFailureBook([cuda_only, broad, narrow], CPU)
    assert book.lookup("test_parity[h-FULL_SHARD-net_flat-ws2]") is broad
    assert book.lookup("test_parity[g-FULL_SHARD-net_flat-ws2]") is None
    assert cuda_only not in book.entries


def test_unused_lists_entries_that_matched_nothing():
    used = entry("test_parity[h-*]", source="f#0", hook="h")
    unused = entry("test_parity[gone-*]", source="f#1", hook="gone")
    book = KnownFailureBook([used, unused], CPU)
    assert book.unused() == [used, unused]
    book.lookup("test_parity[h-NO_SHARD-ws2]")
    book.lookup("test_parity[h-FULL_SHARD-ws2]")
    assert book.unused() == [unused]
    assert book.used == {"f#0": 2}


def test_unused_with_hooks_under_test_skips_entries_about_other_hooks():
    about_h = entry("test_parity[h-*]", source="f#0", hook="h")
    about_other = entry("test_parity[other-*]", source="f#1", hook="other")
    about_nobody = entry("test_parity[x-*]", source="f#2")
    book = KnownFailureBook([about_h, about_other, about_nobody], CPU)
    # An entry about a hook that is not under test is not stale: that hook just was not run.
    assert book.unused(["h"]) == [about_h, about_nobody]
    assert book.unused([]) == [about_nobody]
    assert book.unused(None) == [about_h, about_other, about_nobody]


def test_entries_for_another_machine_are_never_reported_unused():
    book = KnownFailureBook([entry("test_parity[h-*]", device="cuda", hook="h")], CPU)
    assert book.unused() == []
    assert book.lookup("test_parity[h-NO_SHARD-ws2]") is None


def test_an_entry_shadowed_by_an_earlier_one_still_counts_as_used():
    first = entry("test_ddp_*[h-*]", source="f#0")
    later = entry("test_ddp_future_contract[h-*]", source="f#1")
    book = KnownFailureBook([first, later], CPU)
    assert book.lookup("test_ddp_future_contract[h-default-net_flat-ws2]") is first
    assert book.unused() == []


# -- which known failures run ------------------------------------------------------------------


def _item(test, case):
    import types

    name = f"{test}[{case.id}]"
    return types.SimpleNamespace(nodeid=f"suite.py::{name}", name=name,
                                 callspec=types.SimpleNamespace(params={"case": case}))


def _known(**fields):
    from conformance.controller.known_failures import KnownFailure, KnownFailureBook, RunEnvironment

    entry = KnownFailure(reason="because", source="kf#0", **fields)
    return KnownFailureBook([entry], RunEnvironment(backend="gloo", device="cpu", torch_version="2.13.0",
                                                    cuda_build=False))


def _ddp(variant, ws, model="nested_wrapped", check="parity", nodes=1):
    from conformance.apis.registry import HOOK_APIS

    return HOOK_APIS["ddp"].suite_test(check).case("h", variant, ws, model=model, nodes=nodes)


def test_a_sampled_entry_runs_one_case_per_suite_test_and_world_size():
    from conformance.controller.pytest_plugin import _known_failures_run

    items = [_item("test_ddp_parity", _ddp("default", 2)), _item("test_ddp_parity", _ddp("bucket_view", 2)),
             _item("test_ddp_parity", _ddp("default", 3)), _item("test_ddp_averaging", _ddp("default", 2,
                                                                                            "analytic_linear",
                                                                                            "averaging"))]
    runs = _known_failures_run(items, _known(test="test_ddp_*[h-*]", sample=True))
    assert [runs[i.nodeid] for i in items] == [True, False, True, True]
    assert _known_failures_run(items, _known(test="test_ddp_*[h-*]")) == {}  # not sampled: every case runs


def test_a_reach_case_runs_only_where_its_entry_marks_no_ordinary_case_that_runs():
    from conformance.controller.pytest_plugin import _known_failures_run

    small = _item("test_ddp_hard_inputs", _ddp("default", 3, "gradient_probe", "hard_inputs"))
    large = _item("test_ddp_hard_inputs", _ddp("default", 3, "large_probe", "hard_inputs"))
    long = _item("test_ddp_long_run", _ddp("default", 3, check="long_run"))
    two = _item("test_ddp_parity", _ddp("default", 4, nodes=2))
    runs = _known_failures_run([small, large, long, two], _known(test="test_ddp_*[h-*]"))
    assert runs == {large.nodeid: False, long.nodeid: False, two.nodeid: False}
    # An entry that marks only reach cases: they run, and show whether it holds.
    assert _known_failures_run([large, long], _known(test="test_ddp_*[h-*]")) == {}
