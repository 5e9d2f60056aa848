"""Tests for conformance.controller.known_failures' file: reading ``[[failure]]`` entries from TOML, the errors
that name the file and the entry, conditions written in the file (``cuda_build``, ``min_world_size``), encodings,
how a file is named, and a book built from a file.

Every file here is real TOML written to ``tmp_path`` and read back through ``load_known_failures``. Matching
and the book are in ``tests/test_known_failures_book.py``; the repository's own ``fixtures/known_failures.toml``
in ``tests/test_known_failures_repo.py``.
"""

from __future__ import annotations

import textwrap

import pytest

from conformance.controller.known_failures import KnownFailureBook, KnownFailuresError, load_known_failures
from tests.known_failures_helpers import CPU, CUDA, CUDA_BUILD_ON_CPU


@pytest.fixture
def write_toml(tmp_path):
    def write(text: str, name: str = "known_failures.toml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


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


# -- a book read from a file ----------------------------------------------------------------------


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


# -- conditions on the build, encodings, how files are named --------------------------------------


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


def test_a_user_file_below_the_working_directory_is_named_relative_to_it(write_toml, tmp_path, monkeypatch):
    path = write_toml("""
        [[failure]]
        test = "test_x[h-*]"
        reason = "r"
    """, name="mine.toml")
    monkeypatch.chdir(tmp_path)
    (e,) = load_known_failures(path)
    assert e.source == "mine.toml#failure[0]"


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
