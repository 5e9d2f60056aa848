"""``conform --help``: the suite's own usage and options first, each with its variable and default, then pytest's.

Also holds the manual's options table (docs/options.md) to the declared options
(:data:`conformance.controller.options.OPTIONS`), so the help and the manual give the same defaults.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.controller.options import OPTIONS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def help_text(tmp_path_factory) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "conformance", "--help"], cwd=tmp_path_factory.mktemp("anywhere"),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def test_help_opens_with_the_suite_usage_and_its_options_before_pytest_options(help_text):
    lines = help_text.splitlines()
    assert lines[0].startswith("usage: conform [--hook MODULE:ATTR ...]"), lines[:3]
    ours, _, theirs = help_text.partition("\npytest options (any other argument goes to pytest")
    assert theirs, "no pytest section"
    for opt in OPTIONS:
        assert re.search(rf"^  {re.escape(opt.flag)}\b", ours, re.M), f"{opt.flag} missing from the suite's options"
        assert not re.search(rf"^  {re.escape(opt.flag)}\b", theirs, re.M), f"{opt.flag} shown again under pytest"
    assert re.search(r"^  -k EXPRESSION", theirs, re.M) and "--junitxml" in theirs
    for noise in ("pytest.main()", "os.pathsep", "commhook-conformance:", "file_or_dir\n"):
        assert noise not in help_text, noise


def test_help_lists_every_exit_status(help_text):
    """Issue 31: the help listed 0/1/2/4/5 but not 10; it is now written from conformance.exit_codes, each code once."""
    from conformance import exit_codes

    ours = " ".join(help_text.partition("\nconformance options")[0].split())
    codes = {v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)}
    assert {code for code, _ in exit_codes.MEANINGS} == codes
    for code, meaning in exit_codes.MEANINGS:
        assert f"{code} {meaning}" in ours, (code, ours)


def test_every_option_shows_its_environment_variable_and_default(help_text):
    ours = help_text.partition("\npytest options")[0]
    blocks = re.split(r"\n(?=  --)", ours)
    by_flag = {block.split()[0]: " ".join(block.split()) for block in blocks[1:]}
    assert set(by_flag) == {o.flag for o in OPTIONS}
    for opt in OPTIONS:
        text = by_flag[opt.flag]
        assert f"default: {opt.default}" in text, text
        if opt.env:
            assert f"environment: {opt.env}" in text, text
    assert f"environment: CONFORM_KNOWN_FAILURES (separated by {os.pathsep!r})" in by_flag["--known-failures"]


def test_the_options_page_s_table_gives_each_option_its_variable_and_default():
    page = (REPO / "docs" / "options.md").read_text()
    table = page[page.index("\n| option | environment | default |\n") + 1:].split("\n\n", 1)[0]
    rows = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]  # "\|" is a pipe inside a cell
        flag = re.match(r"`(--[a-z-]+)", cells[0]).group(1)
        env = re.match(r"`(CONFORM_[A-Z_]+)`", cells[1])
        rows[flag] = (env.group(1) if env else None, cells[2].replace("`", ""))
    for opt in OPTIONS:
        assert rows.get(opt.flag) == (opt.env, opt.default), f"docs/options.md's row of {opt.flag}: {rows.get(opt.flag)}"
    assert set(rows) - {opt.flag for opt in OPTIONS} == {"--hypothesis-seed"}  # hypothesis's own; no stale row


def test_the_torchrun_page_has_a_loopback_recipe_for_one_machine():
    """Two agents of one rank each, on loopback, CPU and gloo: the form tests/test_torchrun.py runs."""
    section = (REPO / "docs" / "torchrun.md").read_text()
    assert section.startswith("# Across nodes, on torchrun\n"), section[:80]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "--nproc-per-node 1" in b)
    listen = re.search(r"^conform --listen (127\.0\.0\.1:\d+) --world-size 2 --device cpu --backend gloo &$", block,
                       re.M)
    assert listen, block
    agent = " ".join(block.split("\\\n"))
    assert re.search(r"for node in 0 1; do\s+torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
                     r"--rdzv-endpoint 127\.0\.0\.1:\d+ .*--local-addr 127\.0\.0\.1 -m conformance\.worker "
                     rf"--controller {re.escape(listen.group(1))} &", agent), agent
    assert "CONFORM_AUTHKEY_FILE=" in block and "GLOO_SOCKET_IFNAME=lo" in block and "wait $CONTROLLER" in block


def test_every_section_the_help_names_is_in_the_file_it_names(help_text):
    """``conform --help`` points at the manual (``docs/nightly.md, 'Using it as a nightly CI gate'``): each file
    it names exists and holds a heading of exactly that text (sections move between files; issue 48 found three
    that pointed at README after they had moved)."""
    text = " ".join(help_text.partition("\npytest options (")[0].split())  # the suite's part, unwrapped
    refs = re.findall(r"((?:README|docs/[\w-]+)\.md)[,:]? '(.+?)'(?=[),;.]|\s|$)", text)
    assert len(refs) >= 4, refs
    for path, section in refs:
        file = REPO / path
        assert file.is_file(), f"--help names {path}, which does not exist"
        headings = [line.lstrip("#").strip() for line in file.read_text().splitlines() if line.startswith("#")]
        assert section in headings, f"--help names '{section}' in {path}; its headings: {headings}"
