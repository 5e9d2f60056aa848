"""The re-run command works when pasted into a fresh shell: the interpreter that ran the suite where ``conform``
on ``PATH`` is not its own, and absolute paths.

The whole path, a failure's command run with no venv on ``PATH``, is ``tests/test_newcomer.py``.
"""

from __future__ import annotations

import os
import stat
import sys

from conformance.controller.cli import command_words
from tests.test_settings import settings


def _script(directory, first_lines: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "conform"
    path.write_text(first_lines + "\nfrom conformance.controller.cli import main\nmain()\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(directory)


def test_with_no_conform_on_path_the_command_is_this_interpreter_with_dash_m(tmp_path):
    assert command_words(path=str(tmp_path)) == [sys.executable, "-m", "conformance"]


def test_a_conform_of_another_interpreter_is_not_used(tmp_path):
    other = _script(tmp_path / "other_venv" / "bin", "#!/opt/other/bin/python3")
    assert command_words(path=other) == [sys.executable, "-m", "conformance"]


def test_a_conform_that_runs_this_interpreter_is_used(tmp_path):
    mine = _script(tmp_path / "bin", f"#!{sys.executable}")
    assert command_words(path=mine) == ["conform"]
    # pip's form for an interpreter path too long for a #! line
    long_form = _script(tmp_path / "long" / "bin", f"#!/bin/sh\n'''exec' {sys.executable} \"$0\" \"$@\"\n' '''")
    assert command_words(path=long_form) == ["conform"]


def test_the_first_conform_on_path_decides(tmp_path):
    other = _script(tmp_path / "a", "#!/opt/other/bin/python3")
    mine = _script(tmp_path / "b", f"#!{sys.executable}")
    assert command_words(path=os.pathsep.join([other, mine])) == [sys.executable, "-m", "conformance"]
    assert command_words(path=os.pathsep.join([mine, other])) == ["conform"]


def test_rerun_args_make_a_relative_known_failures_file_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text("")
    args = settings(cli={"conform_known_failures": ["mine.toml"]}).rerun_args()
    assert args[args.index("--known-failures") + 1] == str(tmp_path / "mine.toml")
    assert args.count("--known-failures") == 1  # the packaged file always applies; it is not repeated
