"""A local rank's phase travels through a shared page (conformance.shared.phase_board), not a message per phase:
the controller reads the last phase written, from another process, and an empty board after a clear."""

from __future__ import annotations

import os

import pytest

from conformance.shared.phase_board import BOARD_BYTES, PhaseBoard


@pytest.fixture
def board(tmp_path):
    made = PhaseBoard.create(str(tmp_path / "phase-0"))
    yield made
    made.close()


def test_a_new_board_is_empty_and_reads_the_last_phase_written(board):
    assert board.read() == ""
    board.write("step 3: forward/backward of the hooked model (micro-step 0, no_sync)")
    board.write("step 3: optimizer step")
    assert board.read() == "step 3: optimizer step"
    board.write("")
    assert board.read() == ""


def test_a_write_in_another_process_is_read_here(board):
    """The rank is another process that opens the file the controller created: its writes are the
    controller's reads, with no message and no flush."""
    pid = os.fork()
    if pid == 0:  # the rank
        code = 1
        try:
            rank_side = PhaseBoard(board.path)
            rank_side.write("step 7 of 256: training both models (unrecorded) \u2013 r\u00e9sum\u00e9")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert board.read() == "step 7 of 256: training both models (unrecorded) \u2013 r\u00e9sum\u00e9"


def test_a_phase_longer_than_the_board_is_cut_at_a_character(board):
    text = "\u00e9" * BOARD_BYTES  # two bytes each: the bound falls inside one
    board.write(text)
    read = board.read()
    assert 0 < len(read.encode()) <= BOARD_BYTES - 4
    assert text.startswith(read)


def test_create_refuses_an_existing_file(board):
    with pytest.raises(FileExistsError):
        PhaseBoard.create(board.path)


def test_a_notice_stands_beside_the_phase_until_the_next_phase(board):
    """A recorder's contract finding is on the board at once, so a rank that then dies (gloo aborts on a Work a
    hook left running) is reported with it; the rank's own phase is unchanged and the next phase replaces it."""
    import torch

    from conformance.ranks.worker import RankContext

    ctx = RankContext(0, 1, None, torch.device("cpu"), "gloo", board=board)
    ctx.phase("step 0: forward/backward of the hooked model")
    ctx.notice("call 0: the comm neither waited on its Work nor returned it")
    assert board.read() == ("step 0: forward/backward of the hooked model; before it died or hung: "
                            "call 0: the comm neither waited on its Work nor returned it")
    assert ctx.current_phase == "step 0: forward/backward of the hooked model"
    ctx.phase("step 0: optimizer step")
    assert board.read() == "step 0: optimizer step"
