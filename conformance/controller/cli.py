"""``conform`` / ``python -m conformance``: run the conformance suite.

Conformance options (``--hook``, ``--world-size``, ``--backend``, ``--device``,
...; see ``conform --help``) and any pytest argument (``-k``, ``-x``, ``-q``,
``--junitxml``) may be mixed. The exit codes are docs/nightly.md's ("Using it as a
nightly CI gate", :mod:`conformance.exit_codes`): 0 every hook conforms (known
failures allowed), 1 a hook failed a check, 2 the run was interrupted, 4 a usage
error such as a bad hook spec, 5 no case matched ``-k``/``-m``, 10 the run itself
failed (a rank pool that could not start, a report that could not be written).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import shutil
import sys
import textwrap
from typing import List, Optional

from conformance.controller.interruption import process_signals
from conformance.controller.options import OPTIONS
from conformance.controller.zygote_client import start_zygote
from conformance import exit_codes
from conformance.exit_codes import INTERRUPTED

SUITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suite")


def pytest_args(argv: List[str]) -> List[str]:
    """The pytest command line ``conform argv`` runs.

    The suite's own ``pytest.ini`` is used (``-c``), with the suite directory
    as rootdir, so the caller's project configuration does not leak in.
    """
    return ["-c", os.path.join(SUITE_DIR, "pytest.ini"), "--rootdir", SUITE_DIR,
            "-p", "conformance.controller.pytest_plugin", *argv, SUITE_DIR]


def command_words(path: Optional[str] = None) -> List[str]:
    """The words a fresh shell runs this suite with, on this interpreter.

    ``["conform"]`` where the ``conform`` found on ``path`` (default: ``$PATH``)
    runs this interpreter (``sys.executable``: it is the script beside it, or its
    ``#!`` line names it); otherwise ``[sys.executable, "-m", "conformance"]``,
    which needs no ``PATH`` at all (a venv that is not activated, or another
    ``conform`` first on ``PATH``).
    """
    found = shutil.which("conform", path=path)
    if found and _runs_this_interpreter(found):
        return ["conform"]
    return [sys.executable, "-m", "conformance"]


def python_words(path: Optional[str] = None) -> List[str]:
    """The words a fresh shell runs a Python file with on this interpreter: ``["python"]`` where the ``python``
    found on ``path`` (default: ``$PATH``) is in this interpreter's own directory (its venv's ``bin``), else
    ``[sys.executable]``. Symlinks are not followed: a venv's ``python`` links to the system's, which lacks
    the venv's packages."""
    found = shutil.which("python", path=path)
    here = os.path.dirname(os.path.abspath(sys.executable))
    if found and os.path.dirname(os.path.abspath(found)) == here:
        return ["python"]
    return [sys.executable]


def _runs_this_interpreter(script: str) -> bool:
    sibling = os.path.join(os.path.dirname(sys.executable), "conform")
    try:
        if os.path.exists(sibling) and os.path.samefile(script, sibling):
            return True
        with open(script, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace").splitlines()[:3]
    except OSError:
        return False
    # pip writes "#!/path/to/python", or for a long path "#!/bin/sh" then "'''exec' /path/to/python ...".
    words = re.findall(r"[^\s'\"]+", "\n".join(head).replace("#!", " ", 1))
    return any(os.path.isabs(w) and os.path.abspath(w) == os.path.abspath(sys.executable) for w in words)


#: Arguments after which no case runs, so no rank is needed.
_NO_CASES = {"-h", "--help", "--version", "--co", "--collect-only", "--fixtures", "--markers"}


def conformance_help() -> str:
    """The suite's part of ``conform --help``: its usage line, then each option with its variable and default."""
    lines = ["usage: conform [--hook MODULE:ATTR ...] [conformance options] [pytest options]",
             "       python -m conformance ...  (the same command, with this interpreter)",
             "",
             "Checks gradient communication hooks (FSDP, DDP, FSDP2) against PyTorch's own semantics, bit for bit.",
             "With no --hook, PyTorch's built-in hooks are checked.", ""]
    status = "Exit status: " + ", ".join(f"{code} {meaning}" for code, meaning in exit_codes.MEANINGS)
    lines += textwrap.wrap(status + "; docs/nightly.md, 'Using it as a nightly CI gate', says more.", 100)
    lines += ["", "conformance options (the command line wins over the environment variable):"]
    for opt in OPTIONS:
        name = f"{opt.flag} {opt.metavar}" if opt.metavar else opt.flag
        body = textwrap.wrap(opt.help, 72)
        if opt.env:
            body += textwrap.wrap(f"environment: {opt.env_text()}", 72)
        body += textwrap.wrap(f"default: {opt.default}", 72)
        if len(name) <= 22:
            lines.append(f"  {name:<24}{body[0]}")
            body = body[1:]
        else:
            lines.append(f"  {name}")
        lines += [" " * 26 + text for text in body]
    lines += ["", "pytest options (any other argument goes to pytest: -k EXPRESSION, -x, -q, -v, --junitxml=PATH, "
              "...):", ""]
    return "\n".join(lines)


def pytest_help(text: str) -> str:
    """pytest's own ``--help`` as ``conform --help`` shows it, after :func:`conformance_help`: without its
    usage line and positional argument (conform names the suite's directory itself), and without its copy of
    the conformance options."""
    out: List[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("usage: ") or line in ("positional arguments:", "commhook-conformance:"):
            skipping = True
            continue
        if skipping:
            if line.strip() and not line.startswith(" "):  # the next group's title
                skipping = False
            else:
                continue
        out.append(line.replace("type: pytest --", "type: conform --"))
    while out and not out[0].strip():
        out.pop(0)
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the suite; the exit code. Meant to be the process's last act: SIGINT and SIGTERM are handled
    from the start (:func:`conformance.controller.interruption.process_signals`) and ignored once the run
    is over."""
    # Ctrl-C and SIGTERM are handled from here to the process's end, not only while pytest's session is
    # configured: one landing before it starts or while it closes would otherwise end the run by SIGINT.
    signals = process_signals()
    # No cyclic collection while pytest, its plugins and the hooks' modules import: the plugin freezes all of
    # it and collects again once the session is configured (pytest_plugin.pytest_configure).
    gc.disable()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not _NO_CASES.intersection(argv):
            # The zygote imports torch for the ranks while this process imports it for itself.
            start_zygote()
        import pytest  # late: after the zygote started, so that its imports overlap pytest's

        if {"-h", "--help"}.intersection(argv):
            captured = io.StringIO()
            with contextlib.redirect_stdout(captured):
                code = int(pytest.main(pytest_args(argv)))
            print(conformance_help())
            print(pytest_help(captured.getvalue()))
            return code
        return int(pytest.main(pytest_args(argv)))
    except KeyboardInterrupt:  # the first signal, before pytest's session began: no case ran, no report changed
        return INTERRUPTED
    finally:
        signals.ignore()  # the run is over and its exit code decided: the process only exits now


if __name__ == "__main__":
    sys.exit(main())
