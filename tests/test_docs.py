"""The manual runs as written: every command and code block of README.md and docs/*.md still runs or imports.

What each kind of text is held to, without running the suite itself (nothing here starts a rank):

- a Python block: an example module's block (``# examples/my_specs.py``) is in that file verbatim and the module
  imports; every other block runs (``exec``, in a scratch directory holding a results file for the blocks that read
  one), and each ``HookSpec`` it builds is one;
- a TOML block (a known-failures entry) loads with the suite's own known-failures loader;
- a command, in a ``sh``/``bash`` block, a YAML step's ``run:`` or an inline span (``make ...``, ``conform ...``,
  ``python -m ...``, ``torchrun ...``): ``make`` targets and variables exist in the Makefile; ``conform`` and
  ``python -m conformance`` options exist in ``conform --help``; ``--hook MODULE:ATTR`` targets (in ``HOOKS=`` too)
  resolve to specs; ``torchrun`` options exist in torchrun's parser and ``-m MODULE`` options in ``MODULE --help``;
  a script's options are in its source;
- every relative link resolves to a file, and an anchor to a heading of it; every repository path in backticks
  (``conformance/reports/results.py``) exists; every ``conformance.x.y`` in backticks imports; every
  ``CONFORM_*`` variable named is read somewhere in the package.

Output shown in plain fenced blocks (no language) is not run: the tests of each feature hold those.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from typing import Dict

import pytest

from tests.manual_helpers import (INLINE, LINK, MODULE_SPAN, NOT_CHECKED, NOT_MODULES, PAGES, PATH_SPAN, PENDING, REPO,
                                  anchors, blocks, commands, imports, problems_of, prose, rel, simple_commands, slug)


def test_every_command_the_manual_shows_names_what_exists():
    shown = commands()
    checked = [(page, words) for page, text in shown for words in simple_commands(text)
               if os.path.basename(words[0]) not in NOT_CHECKED]
    kinds = {os.path.basename(words[0]) for _, words in checked}
    assert {"make", "conform", "torchrun", "python"} <= kinds, kinds  # the reading above found each kind
    problems = [f"{page}: {' '.join(words)[:120]}: {p}" for page, words in checked for p in problems_of(words)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("words, expected", [
    (["make", "conform", "ARGS=--no-such-flag"], "conform has no option --no-such-flag"),
    (["make", "nosuchtarget"], "the Makefile has no target nosuchtarget"),
    (["make", "conform", "NOSUCHVAR=1"], "the Makefile reads no variable NOSUCHVAR"),
    (["conform", "--hook", "conformance.examples.my_specs:NOPE"], "--hook conformance.examples.my_specs:NOPE does"),
    (["conform", "--hook", "conformance.examples.my_hooks:fp16_hook"], "is not a HookSpec"),
    (["python", "-m", "conformance", "--depth-of-field", "x"], "conform has no option --depth-of-field"),
    (["torchrun", "--nproc-per-gpu", "2", "-m", "conformance.worker", "--controller", "h:1"],
     "torchrun has no option --nproc-per-gpu"),
    (["torchrun", "-m", "conformance.worker", "--contoller", "h:1"], "python -m conformance.worker has no option"),
    (["python", "benchmarks/default_run.py", "--repeats", "3"], "has no option --repeats"),
])
def test_a_command_naming_what_does_not_exist_is_caught(words, expected):
    assert any(expected in p for p in problems_of(words)), problems_of(words)


def test_the_shell_reading_finds_each_command_of_a_script():
    text = ("export A=1 B=2\nfor node in 0 1; do\n  torchrun --nnodes 2 \\\n    -m conformance.worker --controller x &\n"
            "done\nPYTHONPATH=~/r make conform HOOKS=\"a:B\"   # a comment\nsrun torchrun --nnodes 2 -m m\n"
            "conform --world-size $((N * 8)) --device cuda\n")
    assert [w[:2] for w in simple_commands(text)] == [["export", "A=1"], ["for", "node"], ["torchrun", "--nnodes"],
                                                      ["done"], ["make", "conform"], ["torchrun", "--nnodes"],
                                                      ["conform", "--world-size"]]
    assert list(simple_commands(text))[-1] == ["conform", "--world-size", "SUBSTITUTED", "--device", "cuda"]


def test_every_conform_variable_named_is_read_by_the_package():
    named = {v for page in PAGES for v in re.findall(r"\bCONFORM_[A-Z_]*[A-Z]\b", page.read_text(encoding="utf-8"))}
    assert "CONFORM_AUTHKEY_FILE" in named, named
    source = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "conformance").rglob("*.py"))
    assert not sorted(v for v in named if v not in source)


# -- code blocks --------------------------------------------------------------------------------------------

@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory holding what a block may read (a results file), with sys.path restored after."""
    from conformance.reports import results

    reports = tmp_path / "reports"
    reports.mkdir()
    document = results.build_document(
        suite_version="0.1.0",
        run={"started_at": "2026-01-01T00:00:00+00:00", "finished_at": "2026-01-01T00:01:00+00:00",
             "duration_s": 60.0, "exit_status": 0, "interrupted": False, "fail_on": "failures", "args": []},
        environment={"torch_version": "2.13.0+cpu", "torch_build": "cpu", "backend": "gloo", "device": "cpu",
                     "world_sizes": [2, 3]},
        hooks=[], cases=[])
    (reports / "conformance.json").write_text(json.dumps(document))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


PYTHON_BLOCKS = blocks("python")


@pytest.mark.parametrize("page, body", PYTHON_BLOCKS, ids=[f"{p}:{b.splitlines()[0][:40]}" for p, b in PYTHON_BLOCKS])
def test_every_python_block_runs_or_is_its_example_module(page, body, scratch):
    from conformance import HookSpec

    first = body.splitlines()[0]
    example = re.match(r"^# examples/(\w+)\.py", first)
    if example:
        name = example.group(1)
        text = "\n".join(body.splitlines()[1:]) + "\n"
        assert text in (REPO / "examples" / f"{name}.py").read_text(), f"{page}: the block differs from the file"
        importlib.import_module(f"conformance.examples.{name}")
        return
    namespace: Dict[str, object] = {"__name__": "manual_block"}
    exec(compile(body, f"{page}:{first}", "exec"), namespace)  # noqa: S102 - the manual's own example code
    specs = [v for k, v in namespace.items() if k.isupper() and k.endswith(("SPEC", "SPEC2"))]
    assert all(isinstance(s, HookSpec) for s in specs), specs


def test_the_python_blocks_are_read():
    """The examples and the self-contained blocks are both found (the reading is not vacuous)."""
    firsts = [b.splitlines()[0] for _, b in PYTHON_BLOCKS]
    assert "# examples/my_hooks.py" in firsts and "# examples/my_ddp_hook.py" in firsts
    assert sum(not f.startswith("# examples/") for f in firsts) >= 3, firsts


@pytest.mark.parametrize("page, body", blocks("toml"))
def test_every_known_failures_block_loads(page, body, tmp_path):
    from conformance.controller.known_failures import load_known_failures

    path = tmp_path / "known_failures.toml"
    path.write_text(body)
    assert load_known_failures(str(path)), page


# -- links, paths, modules ----------------------------------------------------------------------------------

def test_every_relative_link_resolves_to_a_file_and_heading():
    problems = []
    pending_used = set()
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            shown = os.path.relpath(file, REPO)
            if shown in PENDING:
                pending_used.add(shown)
                continue
            if not file.exists():
                problems.append(f"{rel(page)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{rel(page)}: {target}: no heading #{anchor} in {shown}")
    assert not problems, "\n".join(problems)
    arrived = sorted(p for p in PENDING if (REPO / p).exists())
    assert not arrived, f"{arrived} exist now: remove them from PENDING, so their links are checked"
    assert pending_used == PENDING, PENDING - pending_used  # an entry nothing links to is removed


def test_every_repository_path_and_module_in_backticks_exists():
    problems = []
    for page in PAGES:
        for span in INLINE.findall(prose(page.read_text(encoding="utf-8"))):
            span = span.strip()
            if PATH_SPAN.match(span) and not (REPO / span).exists() and span not in PENDING:
                problems.append(f"{rel(page)}: `{span}`: no such path")
            elif MODULE_SPAN.match(span) and span not in NOT_MODULES and not imports(span):
                problems.append(f"{rel(page)}: `{span}` does not import")
    assert not problems, "\n".join(problems)
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    assert all(f"`{name}`" in text for name in NOT_MODULES), "an entry of NOT_MODULES the manual no longer names"


def test_the_link_and_path_checks_see_what_is_missing(tmp_path):
    assert slug("`fsdp2_all_reduce` hooks") == "fsdp2_all_reduce-hooks"
    assert slug("What runs at 3 ranks, and why") == "what-runs-at-3-ranks-and-why"
    assert imports("conformance.apis.registry") and not imports("conformance.apis.no_such_module")
    page = "See [x](nowhere.md) and `conformance/no_such.py`.\n```sh\n[y](inside_a_block.md)\n```\n"
    assert LINK.findall(prose(page)) == ["nowhere.md"]
    assert [s for s in INLINE.findall(prose(page)) if PATH_SPAN.match(s)] == ["conformance/no_such.py"]


def test_the_readme_is_a_read_of_minutes():
    """Issue 29: README.md at or under 300 lines, linking the manual's table of contents."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300, len(readme.splitlines())
    assert "(docs/README.md)" in readme
    toc = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", toc))
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"pages the table of contents does not list: {sorted(pages - listed)}"


def test_no_figure_is_narrated_by_commit():
    """Current figures only, each with its date: no "at <commit>", "A later make bench", "Today (at ...)"."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for pattern in (r"\bat [0-9a-f]{7,40}\b", r"\bA later `make", r"\bToday \(at", r"\([0-9a-f]{7}, \d+ cases"):
            assert not re.search(pattern, text), (rel(page), pattern, re.search(pattern, text).group(0))


@pytest.mark.skipif(not __import__("shutil").which("timeout"), reason="needs coreutils' timeout")
def test_the_manual_s_timeout_passes_the_runs_own_exit_status_through():
    """docs/running.md: under ``timeout`` a run stopped by its signal exits 124, the run's own 2 only with
    ``--preserve-status`` (issue 48). A child that exits 2 on SIGINT, as the suite does, stands for the run."""
    import subprocess

    manual = open(os.path.join(REPO, "docs", "running.md")).read()
    assert "timeout --preserve-status -s INT" in manual
    # os._exit: timeout signals the child, then its whole process group, so a second SIGINT can reach a child that
    # is finalising after sys.exit, with Python's default handler back (130)
    child = [sys.executable, "-c", "import os, signal, time\n"
             "signal.signal(signal.SIGINT, lambda *_: os._exit(2))\nprint('ready', flush=True)\ntime.sleep(30)"]
    # 2 s before the signal: a loaded machine can take over a second to start the child and set its handler
    plain = subprocess.run(["timeout", "-s", "INT", "2", *child], stdout=subprocess.PIPE, timeout=60)
    kept = subprocess.run(["timeout", "--preserve-status", "-s", "INT", "2", *child], stdout=subprocess.PIPE,
                          timeout=60)
    assert (plain.returncode, kept.returncode) == (124, 2)
