"""Reading the manual (README.md and docs/*.md) for tests/test_docs.py: its fenced blocks, its commands as a shell
splits them, and what is wrong with each command (a Makefile target or variable, a ``conform``, torchrun or
``python -m`` option, a ``--hook`` target that does not exist)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Top-level modules the manual names as the reader's own (``--hook my_pkg.specs:SPECS``): never resolved here.
READERS_OWN = {"my_pkg", "other", "mytrain"}
#: Pages linked before they exist (none today). Once one exists, the test that reads this set fails until its
#: entry is removed, so the set never hides a broken link.
PENDING: set = set()
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


def imports(dotted: str) -> bool:
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
