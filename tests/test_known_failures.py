"""Tests for conformance.controller.known_failures: the TOML file, pattern matching, conditions, the book.

Every file here is real TOML written to ``tmp_path`` and read back through
``load_known_failures``; the repository's own ``fixtures/known_failures.toml`` is
checked against the built-in hooks and the case ids the suite generates.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conformance.shared.spec_loading import load_specs
from tests.meta_helpers import plan_settings, planned_test_names
from conformance import cases
from conformance.apis.fsdp import builtin_hooks as builtin_fsdp
from conformance.controller.known_failures import (
    KnownFailure,
    KnownFailureBook,
    KnownFailuresError,
    RunEnvironment,
    load_known_failures,
)

REPO = Path(__file__).resolve().parents[1]
CPU = RunEnvironment(backend="gloo", device="cpu", torch_version="2.13.0+cpu")
CUDA = RunEnvironment(backend="nccl", device="cuda", torch_version="2.13.0+cu126")


@pytest.fixture
def write_toml(tmp_path):
    def write(text: str, name: str = "known_failures.toml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def entry(test, **kw) -> KnownFailure:
    return KnownFailure(test=test, reason=kw.pop("reason", "because"), source=kw.pop("source", "t#0"), **kw)


# -- parsing ---------------------------------------------------------------------------------


def test_entries_are_read_with_every_field(write_toml):
    path = write_toml("""
        [[failure]]
        test = "test_parity[my_hook-*]"
        hook = "my_hook"
        reason = "rounds twice"
        backend = "gloo"
        device = "cpu"
        torch = ">=2.13"

        [[failure]]
        test = ["test_averaging[other-NO_SHARD-ws2]", "test_parity[other-*]"]
        reason = "drops the predivide"
    """)
    first, second = load_known_failures(path)
    assert first.test == ("test_parity[my_hook-*]",)
    assert (first.hook, first.reason, first.backend, first.device, first.torch) == (
        "my_hook", "rounds twice", "gloo", "cpu", ">=2.13")
    assert second.test == ("test_averaging[other-NO_SHARD-ws2]", "test_parity[other-*]")
    assert (second.hook, second.backend, second.device, second.torch) == (None, None, None, None)
    assert first.source == f"{path}#failure[0]" and second.source == f"{path}#failure[1]"


def test_empty_file_has_no_entries(write_toml):
    assert load_known_failures(write_toml("# nothing known to fail\n")) == []


def test_missing_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(KnownFailuresError, match="nope.toml"):
        load_known_failures(str(path))


GOOD = '''
[[failure]]
test = "test_parity[fine-*]"
reason = "a good entry first, so the bad one is the second"
'''


@pytest.mark.parametrize("bad_entry, complaint", [
    ('test = "x"\nreason = "r"\nplatform = "linux"\n', "platform"),
    ('test = "x"\n', "reason"),
    ('test = "x"\nreason = "   "\n', "reason"),
    ('reason = "r"\n', "'test'"),
    ('test = []\nreason = "r"\n', "'test'"),
    ('test = ["x", ""]\nreason = "r"\n', "'test'"),
    ('test = "x"\nreason = "r"\ntorch = "at least 2.13"\n', "'at least 2.13'"),
])
def test_bad_entry_names_the_file_and_the_entry(write_toml, bad_entry, complaint):
    path = write_toml(GOOD + "\n[[failure]]\n" + bad_entry)
    with pytest.raises(KnownFailuresError) as info:
        load_known_failures(path)
    message = str(info.value)
    assert f"{path}#failure[1]" in message
    assert complaint in message


def test_torch_condition_that_is_not_a_string_is_a_file_error(write_toml):
    # `torch = 2.13` (a TOML float) is an easy slip; it must be reported like any bad specifier.
    path = write_toml(GOOD + "\n[[failure]]\ntest = \"x\"\nreason = \"r\"\ntorch = 2.13\n")
    with pytest.raises(KnownFailuresError) as info:
        load_known_failures(path)
    assert f"{path}#failure[1]" in str(info.value)


def test_invalid_toml_names_the_file(write_toml):
    path = write_toml('[[failure]]\ntest = "unterminated\n')
    with pytest.raises(KnownFailuresError) as info:
        load_known_failures(path)
    assert path in str(info.value)
    assert "TOML" in str(info.value)


def test_unknown_top_level_key_names_the_file(write_toml):
    path = write_toml('[[failures]]\ntest = "x"\nreason = "r"\n')
    with pytest.raises(KnownFailuresError) as info:
        load_known_failures(path)
    assert path in str(info.value)
    assert "failures" in str(info.value) and "[[failure]]" in str(info.value)


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


def test_book_from_a_file(write_toml):
    path = write_toml("""
        [[failure]]
        test = "test_parity[h-*]"
        hook = "h"
        reason = "on cpu"
        device = "cpu"

        [[failure]]
        test = "test_parity[h-*]"
        hook = "h"
        reason = "on cuda"
        device = "cuda"
    """)
    cpu_book = KnownFailureBook(load_known_failures(path), CPU)
    cuda_book = KnownFailureBook(load_known_failures(path), CUDA)
    assert cpu_book.lookup("test_parity[h-NO_SHARD-ws2]").reason == "on cpu"
    assert cuda_book.lookup("test_parity[h-NO_SHARD-ws2]").reason == "on cuda"

    # A one-GPU machine: world size 1 on NCCL, its cross-rank pools (2, 3) gloo on the CPU. Each case is
    # matched where its ranks run, so PyTorch's CPU-only bugs stay known failures in the CPU pools.
    one_gpu = KnownFailureBook(load_known_failures(path), CUDA, placements={1: ("nccl", "cuda"), 2: ("gloo", "cpu"),
                                                                            3: ("gloo", "cpu")})
    assert one_gpu.lookup("test_parity[h-NO_SHARD-ws1]").reason == "on cuda"
    assert one_gpu.lookup("test_parity[h-NO_SHARD-ws2]").reason == "on cpu"
    assert one_gpu.lookup("test_parity[h-NO_SHARD-ws3]").reason == "on cpu"
    assert one_gpu.lookup("test_parity[h-NO_SHARD]").reason == "on cuda"  # no world size: the run's


# -- the repository's own file --------------------------------------------------------------------


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
        names = planned_test_names([specs[e.hook]])
        for pattern in e.test:
            single = KnownFailure(test=pattern, reason=e.reason, source=e.source)
            assert any(single.matches(n) for n in names), (e.source, pattern)
            # ...and only the cases of the hook it is about.
            other = next(s for s in builtin_fsdp.FSDP_HOOKS if s.name != e.hook)
            assert not any(single.matches(n) for n in planned_test_names([other])), (e.source, pattern)


#: Each API's short parity test and its long run: the long run trains the parity case's default config for
#: more steps, so a hook whose every parity case fails the same way fails its long run too.
PARITY_AND_LONG_RUN = (("test_parity", "test_long_run"), ("test_ddp_parity", "test_ddp_long_run"),
                       ("test_fsdp2_parity", "test_fsdp2_long_run"),
                       ("test_fsdp2_replica_parity", "test_fsdp2_replica_long_run"),
                       ("test_fsdp2_all_gather_parity", "test_fsdp2_all_gather_long_run"))


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


# -- conditions on the build, encodings, how files are named --------------------------------------

CUDA_BUILD_ON_CPU = RunEnvironment(backend="gloo", device="cpu", torch_version="2.11.0+cu128", cuda_build=True)


def test_cuda_build_condition_depends_on_the_build_not_the_device(write_toml):
    path = write_toml("""
        [[failure]]
        test = "test_ddp_parity[h-*]"
        cuda_build = false
        reason = "refused on a CPU build"
    """)
    (e,) = load_known_failures(path)
    assert e.cuda_build is False and "cuda_build=false" in e.conditions()
    assert e.applies(CPU)
    assert not e.applies(CUDA_BUILD_ON_CPU)  # same device and backend, but a CUDA build


def test_cuda_build_must_be_a_boolean(write_toml):
    path = write_toml("""
        [[failure]]
        test = "test_x[h-*]"
        cuda_build = "no"
        reason = "r"
    """)
    with pytest.raises(KnownFailuresError, match=r"cuda_build = 'no' must be true or false"):
        load_known_failures(path)


def test_a_file_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[[failure]]\ntest = "test_x[h-*]"\nreason = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(KnownFailuresError) as info:
        load_known_failures(str(path))
    msg = str(info.value)
    assert "is not UTF-8" in msg and "byte 0xe9 on line 3" in msg and "re-save it as UTF-8" in msg


def test_the_packaged_file_is_named_by_its_repository_path(repo_entries):
    assert all(e.source.startswith("fixtures/known_failures.toml#failure[") for e in repo_entries)


def test_a_user_file_below_the_working_directory_is_named_relative_to_it(write_toml, tmp_path, monkeypatch):
    path = write_toml("""
        [[failure]]
        test = "test_x[h-*]"
        reason = "r"
    """, name="mine.toml")
    monkeypatch.chdir(tmp_path)
    (e,) = load_known_failures(path)
    assert e.source == "mine.toml#failure[0]"


def test_an_entry_shadowed_by_an_earlier_one_still_counts_as_used():
    first = entry("test_ddp_*[h-*]", source="f#0")
    later = entry("test_ddp_future_contract[h-*]", source="f#1")
    book = KnownFailureBook([first, later], CPU)
    assert book.lookup("test_ddp_future_contract[h-default-net_flat-ws2]") is first
    assert book.unused() == []


def test_repo_file_bf16_refusal_applies_to_cpu_builds_only(repo_entries):
    name = "test_ddp_parity[ddp_bf16_compress_hook-default-nested_wrapped-ws2]"
    assert KnownFailureBook(repo_entries, CPU).lookup(name) is not None
    # a CUDA build accepts the hook even without a GPU, and the hook conforms there
    assert KnownFailureBook(repo_entries, CUDA_BUILD_ON_CPU).lookup(name) is None
    contract = "test_ddp_future_contract[ddp_bf16_compress_wrapper_allreduce-default-net_flat-ws2]"
    assert KnownFailureBook(repo_entries, CUDA_BUILD_ON_CPU).lookup(contract) is not None


def test_min_world_size_leaves_one_rank_cases_out(write_toml):
    path = write_toml("""
        [[failure]]
        test = "test_ddp_parity[noop-*]"
        reason = "never communicates"
        min_world_size = 2
    """)
    (noop,) = load_known_failures(path)
    assert noop.matches("test_ddp_parity[noop-default-net_flat-ws2]")
    assert noop.matches("test_ddp_parity[noop-default-net_flat-ws3]")
    assert not noop.matches("test_ddp_parity[noop-default-net_flat-ws1]")
    assert noop.matches("test_ddp_parity[noop-default-net_flat]")  # no world size in the id: it applies


@pytest.mark.parametrize("value", ["2", 0, 1.5, True])
def test_min_world_size_must_be_a_whole_number_of_ranks(write_toml, value):
    path = write_toml(f"""
        [[failure]]
        test = "t"
        reason = "r"
        min_world_size = {value!r}
    """.replace("True", "true").replace("'2'", '"2"'))
    with pytest.raises(KnownFailuresError, match="min_world_size"):
        load_known_failures(path)


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
