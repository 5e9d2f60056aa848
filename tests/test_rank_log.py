"""A rank's output is read from its pipe as it comes, and only a bounded part of each case is kept."""

from __future__ import annotations

import os
import threading

import pytest

from conformance.shared.rank_log import RankLog, cut_note


@pytest.fixture
def pipe_log():
    logs = []

    def make(limit_bytes):
        r, w = os.pipe()
        log = RankLog(r, limit_bytes)
        logs.append((log, w))
        return log, w

    yield make
    for log, w in logs:
        log.close()
        try:
            os.close(w)
        except OSError:
            pass


def test_output_that_fits_is_kept_whole(pipe_log):
    log, w = pipe_log(1000)
    os.write(w, b"hello from rank 1\n")
    assert log.excerpt(1000, 2000) == "hello from rank 1\n"


def test_mark_starts_a_new_case(pipe_log):
    log, w = pipe_log(1000)
    os.write(w, b"case one\n")
    log.mark()
    os.write(w, b"case two\n")
    assert log.excerpt(1000, 2000) == "case two\n"


def test_an_excerpt_keeps_both_ends_and_counts_what_it_leaves_out(pipe_log):
    log, w = pipe_log(10_000)
    os.write(w, b"A" * 100 + b"B" * 5000 + b"C" * 200)
    text = log.excerpt(100, 200)
    assert text == "A" * 100 + f"\n{cut_note(5000)}\n" + "C" * 200
    assert cut_note(5000) == "... 5000 bytes of rank output cut ..."


def test_a_rank_that_prints_without_end_costs_at_most_the_limit_and_is_never_blocked(pipe_log):
    """10 MB through a 64 KiB pipe: the reader thread drains it while the writer writes."""
    log, w = pipe_log(4096)
    chunk = b"x" * 65536
    writer = threading.Thread(target=lambda: [os.write(w, chunk) for _ in range(160)])
    writer.start()
    writer.join(timeout=30)
    assert not writer.is_alive(), "the rank was blocked on its output"
    os.write(w, b"\nTraceback: the last words\n")
    text = log.excerpt(1000, 2000)
    assert log.total_bytes == 160 * 65536 + 27
    assert text.endswith("Traceback: the last words\n")
    assert text.startswith("x" * 1000 + "\n")
    assert cut_note(160 * 65536 + 27 - 3000) in text
    assert len(log._head) + len(log._tail) == 4096


def test_end_of_file_keeps_what_was_written(pipe_log):
    log, w = pipe_log(1000)
    os.write(w, b"last words\n")
    os.close(w)
    log._thread.join(timeout=5)
    assert not log._thread.is_alive(), "the reader did not stop at end of file"
    assert log.excerpt(1000, 2000) == "last words\n"
