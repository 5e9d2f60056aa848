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
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Top-level modules the manual names as the reader's own (``--hook my_pkg.specs:SPECS``): never resolved here.
READERS_OWN = {"my_pkg", "other", "mytrain"}
#: Pages another part of issue 29 writes, linked before they exist on this branch. Once one exists, the test that
#: reads this set fails until its entry is removed, so the set never hides a broken link.
PENDING = {"docs/layers.md"}
#: Dotted names in backticks that are not modules, and what they are.
NOT_MODULES = {"conformance.hooks": "the entry-point group of installed specs"}
#: Commands whose words are not checked (shell built-ins, coreutils, the scheduler's).
NOT_CHECKED = {"export", "mkdir", "cp", "echo", "wait", "chmod", "cat", "umask", "scontrol", "head", "exit", "if",
               "fi", "then", "else", "done", "for", "status=0", "kill", "git", "pip", "cd"}
#: Words before a command that do not change which command it is.
PREFIXES = {"do", "then", "else", "time", "exec", "srun", "!"}

FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH_SPAN = re.compile(r"^(?:conformance|tests|models|fixtures|examples|benchmarks|scripts|docs)/[\w./-]*$")
MODULE_SPAN = re.compile(r"^conformance(?:\.\w+)+$")
COMMAND_SPAN = re.compile(r"^(?:make|conform|torchrun|python3?) ")


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def prose(text: str) -> str:
    """The page without its fenced blocks (where inline spans and links are read)."""
    return FENCE.sub("", text)


def blocks(lang: str) -> List[Tuple[str, str]]:
    """(page, dedented body) of every fenced block in ``lang`` ("" for plain blocks)."""
    found = []
    for page in PAGES:
        for indent, language, body in FENCE.findall(page.read_text(encoding="utf-8")):
            if language == lang:
                found.append((rel(page), textwrap.dedent(body)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(page.read_text(encoding="utf-8")), re.M)}


# -- commands -----------------------------------------------------------------------------------------------

def yaml_runs(body: str) -> Iterator[str]:
    """Every ``run:`` of a YAML workflow, one-line or ``run: |``, as the shell gets it."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(?:- )?run: (.*)$", line)
        if not m:
            continue
        if m.group(2).strip() != "|":
            yield m.group(2)
            continue
        indent = len(m.group(1))
        script = []
        for more in lines[i + 1:]:
            if more.strip() and len(more) - len(more.lstrip()) <= indent:
                break
            script.append(more)
        yield textwrap.dedent("\n".join(script))


def commands() -> List[Tuple[str, str]]:
    """(page, shell text) of every command the manual shows."""
    found = [(page, body) for lang in ("sh", "bash", "shell") for page, body in blocks(lang)]
    found += [(page, run) for page, body in blocks("yaml") for run in yaml_runs(body)]
    for page in PAGES:
        for span in INLINE.findall(prose(page.read_text(encoding="utf-8"))):
            if COMMAND_SPAN.match(span):
                found.append((rel(page), span))
    return found


def simple_commands(text: str) -> Iterator[List[str]]:
    """The words of each simple command of a shell text: continuations joined, comments dropped, split at line
    ends, ``;``, ``&&``, ``||``, ``|``, ``&`` and parentheses; variable assignments and ``do``/``srun`` before it dropped."""
    text = re.sub(r"\$\(\(.*?\)\)|\$\([^)]*\)", "SUBSTITUTED", text.replace("\\\n", " "))  # $((...)), $(...)
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: List[str] = []
        for token in list(lexer) + [";"]:
            if token and set(token) <= set(";&|()"):
                while words and (words[0] in PREFIXES or re.match(r"^[A-Za-z_]\w*=", words[0])):
                    words.pop(0)
                if words:
                    yield words
                words = []
            else:
                words.append(token)


@lru_cache(maxsize=None)
def help_flags(*command: str) -> Set[str]:
    """Every ``--flag`` the ``--help`` of ``python <command>`` names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, *command, "--help"], cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, (command, proc.stdout[-2000:])
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", proc.stdout))


@lru_cache(maxsize=None)
def torchrun_flags() -> Set[str]:
    from torch.distributed.run import get_args_parser

    return {flag for flag in get_args_parser()._option_string_actions if flag.startswith("--")}


@lru_cache(maxsize=None)
def makefile() -> Tuple[Set[str], Set[str]]:
    """The Makefile's targets and the variables it reads."""
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+) \?=", text, re.M)) | set(re.findall(r"\$\(([A-Z_]+)\)", text))
    return targets, variables


def flags_of(words: List[str]) -> List[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def hook_targets(words: List[str]) -> List[str]:
    found = []
    for i, word in enumerate(words):
        if word == "--hook" and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith("--hook="):
            found.append(word.split("=", 1)[1])
    return found


def problems_of_conform(words: List[str]) -> List[str]:
    """``words`` are conform's arguments."""
    known = help_flags("-m", "conformance")
    out = [f"conform has no option {flag}" for flag in flags_of(words) if flag not in known]
    return out + [p for target in hook_targets(words) for p in problems_of_hook_target(target)]


def problems_of_hook_target(target: str) -> List[str]:
    from conformance import HookSpec

    module, _, attr = target.partition(":")
    if not attr:
        return [f"--hook {target}: not MODULE:ATTR"]
    if module.split(".")[0] in READERS_OWN or "$" in target:
        return []
    try:
        value = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        return [f"--hook {target} does not resolve: {type(exc).__name__}: {exc}"]
    specs = value if isinstance(value, (list, tuple)) else [value]
    if not specs or not all(isinstance(s, HookSpec) for s in specs):
        return [f"--hook {target} is not a HookSpec or a list of them: {value!r}"]
    return []


def problems_of(words: List[str]) -> List[str]:
    """What is wrong with one simple command the manual shows ([] when nothing is)."""
    name = os.path.basename(words[0])
    if name == "make":
        rest = words[1:]
        targets, variables = makefile()
        out = []
        skip = False
        for word in rest:
            if skip:
                skip = False
            elif word == "-C":
                skip = True
            elif "=" in word:
                var, value = word.split("=", 1)
                if var not in variables:
                    out.append(f"the Makefile reads no variable {var}")
                elif var == "HOOKS":
                    out += [p for t in value.split() for p in problems_of_hook_target(t)]
                elif var == "ARGS":
                    out += problems_of_conform(shlex.split(value))
            elif word != "..." and not word.startswith("-") and word not in targets:
                out.append(f"the Makefile has no target {word}")
        return out
    if name == "conform":
        return problems_of_conform(words[1:])
    if name == "torchrun":
        out = []
        rest = words[1:]
        if "-m" in rest:
            at = rest.index("-m")
            rest, module, args = rest[:at], rest[at + 1], rest[at + 2:]
            out += problems_of_module(module, args)
        known = torchrun_flags()
        return out + [f"torchrun has no option {flag}" for flag in flags_of(rest) if flag not in known]
    if re.match(r"^python(3(\.\d+)?)?$", name):
        if len(words) > 2 and words[1] == "-m":
            return problems_of_module(words[2], words[3:])
        if len(words) > 1 and re.match(r"^(benchmarks|scripts)/\w+\.py$", words[1]):
            script = REPO / words[1]
            if not script.is_file():
                return [f"no script {words[1]}"]
            source = script.read_text()
            return [f"{words[1]} has no option {flag}" for flag in flags_of(words[2:]) if f'"{flag}"' not in source]
        return []
    return []


def problems_of_module(module: str, args: List[str]) -> List[str]:
    if module == "conformance":
        return problems_of_conform(args)
    if importlib.util.find_spec(module) is None:
        return [f"python -m {module}: no such module"]
    known = help_flags("-m", module)
    return [f"python -m {module} has no option {flag}" for flag in flags_of(args) if flag not in known]


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
            elif MODULE_SPAN.match(span) and span not in NOT_MODULES and not _imports(span):
                problems.append(f"{rel(page)}: `{span}` does not import")
    assert not problems, "\n".join(problems)
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    assert all(f"`{name}`" in text for name in NOT_MODULES), "an entry of NOT_MODULES the manual no longer names"


def _imports(dotted: str) -> bool:
    """``conformance.a.b`` is a module, or an attribute of the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_the_link_and_path_checks_see_what_is_missing(tmp_path):
    assert slug("`fsdp2_all_reduce` hooks") == "fsdp2_all_reduce-hooks"
    assert slug("What runs at 3 ranks, and why") == "what-runs-at-3-ranks-and-why"
    assert _imports("conformance.apis.registry") and not _imports("conformance.apis.no_such_module")
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
