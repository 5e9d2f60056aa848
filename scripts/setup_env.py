"""Make the interpreter running this script ready for ``make conform`` and ``make test``.

Run by the Makefile as ``$(PYTHON) scripts/setup_env.py``; standard library only,
because nothing else may be installed yet. What it does, in order:

1. torch: an importable torch is used as it is and **never** replaced. Where
   none is installed, ``torch==2.13.0`` is installed (a bare ``torch`` would
   pull several GB of CUDA packages). A torch that is installed but fails to
   import is an error: installing over it would replace the user's torch.
2. This package, editable, with its small dependencies (pyproject.toml;
   torch is deliberately not among them). With ``--test`` (``make test``
   and ``make test-fast``), also its ``test`` extra: import-linter, which
   checks the package's layers. ``make conform`` never needs it, so an
   offline GPU node runs the suite without carrying the linter's wheels.

   ``pip install -e .`` builds a PEP 660 editable wheel. Where the
   interpreter's own setuptools can build it without downloads (setuptools
   >= 70.1, or >= 64 with the ``wheel`` package), the build runs with
   ``--no-build-isolation``, so an offline GPU node works once the small
   dependencies are present. Otherwise (a Python 3.11 venv ships setuptools
   65.5 without ``wheel``; a Python 3.12 venv has no setuptools at all) pip
   builds in an isolated environment, which fetches setuptools from the
   package index.
3. The package's modules (and, with ``--test``, ``tests/``) byte-compiled in
   place, as pip compiles a regular install's. An editable install is
   imported from the checkout, which pip leaves uncompiled, and where
   ``PYTHONDONTWRITEBYTECODE`` is set (it is on this project's machines)
   every process of a run compiled the suite's modules again: about 0.4 s
   of CPU for a run's controller and zygote together, in each of the fifty
   runs of the suite ``make test`` starts.

Exit status: 0 ready; 2 setup failed, with a message that says what to do.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import re
import subprocess
import sys
from typing import Optional, Tuple

#: Installed where the interpreter has no torch: the CPU build on this project's machines.
DEFAULT_TORCH = "torch==2.13.0"
#: The oldest torch the suite supports (FSDP2 and the hook APIs it checks need newer ones; see README).
MIN_TORCH = (2, 4)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What the suite imports at run time (distribution name, import name).
SMALL_DEPENDENCIES = (("numpy", "numpy"), ("pytest", "pytest"), ("hypothesis", "hypothesis"),
                      ("pytest-timeout", "pytest_timeout"), ("expecttest", "expecttest"),
                      ("packaging", "packaging"), ("jsonschema", "jsonschema"), ("coverage", "coverage")
                      ) + ((("tomli", "tomli"),) if sys.version_info < (3, 11) else ())
#: What ``make test`` needs besides (the ``test`` extra), where this Python can install it.
TEST_DEPENDENCIES = (("import-linter", "importlinter"),) if sys.version_info >= (3, 10) else ()


def say(message: str) -> None:
    print(f"setup: {message}", flush=True)


def fail(message: str) -> "None":
    print(f"setup: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def pip(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])


def version_tuple(text: str) -> Tuple[int, ...]:
    """``"2.11.0+cu128"`` -> ``(2, 11, 0)``, ``"70.1.0rc1"`` -> ``(70, 1, 0)``: the release fields only."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def installed_version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def ensure_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        say(f"no torch found for {sys.executable}; installing {DEFAULT_TORCH}")
        if pip("install", DEFAULT_TORCH) != 0:
            fail(f"could not install {DEFAULT_TORCH}. Install the torch you want first "
                 f"({sys.executable} -m pip install torch==...); setup never replaces an installed torch")
        return
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if probe.returncode != 0:
        fail("torch is installed but does not import, and setup will not replace it:\n"
             + probe.stderr.strip()[-2000:])
    version = probe.stdout.strip()
    if version_tuple(version) < MIN_TORCH:
        fail(f"torch {version} is older than {'.'.join(map(str, MIN_TORCH))}, the oldest the suite supports; "
             "setup never replaces an installed torch: use a venv with torch>=2.4")
    say(f"using the installed torch {version} (never replaced)")


def can_build_offline() -> bool:
    """Whether the interpreter's setuptools builds an editable wheel with no downloads."""
    setuptools = installed_version("setuptools")
    if setuptools is None:
        return False
    version = version_tuple(setuptools)
    if version >= (70, 1):  # bdist_wheel moved into setuptools in 70.1
        return True
    return version >= (64,) and installed_version("wheel") is not None


def install_package(test_extra: bool = False) -> None:
    args = ["install", "-e", f"{REPO}[test]" if test_extra else REPO]
    if can_build_offline():
        args.insert(1, "--no-build-isolation")
        say(f"installing {REPO} (editable) with the interpreter's setuptools {installed_version('setuptools')}")
    else:
        say(f"installing {REPO} (editable); the interpreter's setuptools "
            f"({installed_version('setuptools') or 'none'}) cannot build it offline, so pip builds it in an "
            "isolated environment")
    if pip(*args) == 0:
        return
    missing = [dist for dist, module in SMALL_DEPENDENCIES + (TEST_DEPENDENCIES if test_extra else ())
               if importlib.util.find_spec(module) is None]
    hints = []
    if missing:
        hints.append(f"install the small dependencies first: {sys.executable} -m pip install {' '.join(missing)}")
    if not can_build_offline():
        hints.append(f"to install without network access, give the interpreter a setuptools that builds "
                     f"editable wheels: {sys.executable} -m pip install 'setuptools>=70.1' (or 'wheel')")
    fail("could not install the package (no network access?). " + "; ".join(hints or ["see pip's output above"]))


def main(argv: Optional[list] = None) -> int:
    """``setup_env.py`` readies the suite (``make conform``); ``setup_env.py --test`` adds the project's test
    extra (``make test``), after the first has run."""
    test_extra = "--test" in (sys.argv[1:] if argv is None else argv)
    if sys.version_info < (3, 9):
        fail(f"Python {sys.version.split()[0]} is too old; the suite needs Python 3.9 or newer")
    ensure_torch()
    install_package(test_extra)
    for folder in ("conformance", "tests") if test_extra else ("conformance",):
        compileall.compile_dir(os.path.join(REPO, folder), quiet=1)
    check = subprocess.run([sys.executable, "-c", "import torch, pytest, hypothesis, numpy, conformance.models, "
                            "conformance.fixtures; print(torch.__version__)"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.path.expanduser("~"))
    if check.returncode != 0:
        fail("the package installed but does not import:\n" + check.stdout[-2000:])
    say(f"torch {check.stdout.strip()} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
