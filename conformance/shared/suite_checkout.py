"""A checkout of this suite on ``sys.path`` never shadows a user's own packages.

The repository keeps ``models/``, ``fixtures/`` and ``examples/`` as top-level
folders, and installs them as ``conformance.models``, ``conformance.fixtures``
and ``conformance.examples`` (``package-dir`` in ``pyproject.toml``). A checkout
directory on ``sys.path`` (the working directory of ``make conform``, or a
``PYTHONPATH`` entry) would still make them importable as top-level ``models``,
``fixtures`` and ``examples``, and hide a user's packages of those names, which
most ML repositories have. Two rules keep that from happening, wherever the run
starts:

* :func:`order_user_paths` puts a checkout after every other user path entry (the
  working directory and ``PYTHONPATH``), so a user's ``tests`` package (the
  checkout's ``tests/`` is the project's own, ``tests.zoo``) wins too;
* :class:`CheckoutGuard`, first on ``sys.meta_path`` (:func:`install`), resolves
  the top-level names of :data:`SUITE_FOLDERS` from everywhere except a checkout:
  the other ``sys.path`` entries, site-packages, and installed packages' own
  finders (a setuptools editable install appends one to ``sys.meta_path``, after
  the path finder that would otherwise find the checkout's folder first). Where
  none has the name, the import fails with a message that names the
  ``conformance.`` module meant instead.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Iterable, List, Optional, Sequence

__all__ = ["SUITE_FOLDERS", "CheckoutGuard", "install", "is_suite_checkout", "order_user_paths"]

#: The repository's top-level folders that install under ``conformance.`` (pyproject.toml's package-dir).
SUITE_FOLDERS = ("models", "fixtures", "examples")


def is_suite_checkout(directory: str) -> bool:
    """Whether ``directory`` is a checkout of this suite: it holds the ``conformance`` package's source
    beside at least one of :data:`SUITE_FOLDERS`. Any copy counts, not only the running one."""
    if not directory or not os.path.isfile(os.path.join(directory, "conformance", "spec.py")):
        return False
    return any(os.path.isdir(os.path.join(directory, folder)) for folder in SUITE_FOLDERS)


def order_user_paths(paths: Sequence[str]) -> List[str]:
    """``paths`` without duplicates, every suite checkout moved after the other entries (order kept otherwise)."""
    unique = list(dict.fromkeys(paths))
    checkouts = [p for p in unique if is_suite_checkout(p)]
    return [p for p in unique if p not in checkouts] + checkouts


def _absolute(entry: str) -> str:
    return os.path.abspath(entry) if entry else os.getcwd()


def _within(spec: importlib.machinery.ModuleSpec, directories: Iterable[str]) -> bool:
    places = [spec.origin or "", *(spec.submodule_search_locations or ())]
    for directory in directories:
        for place in places:
            try:
                if place and os.path.commonpath([os.path.abspath(place), directory]) == directory:
                    return True
            except ValueError:  # another drive (Windows)
                continue
    return False


class CheckoutGuard:
    """A ``sys.meta_path`` finder for the top-level names of :data:`SUITE_FOLDERS` only.

    It asks every other finder in turn, the path finder over ``sys.path`` without
    the suite checkouts, and takes the first module that does not come from a
    checkout's folder.

    Raises:
        ModuleNotFoundError: (from ``import``) no such module outside the checkouts;
            the message names the ``conformance.`` module that holds the folder.
    """

    @classmethod
    def find_spec(cls, fullname: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[importlib.machinery.ModuleSpec]:
        if path is not None or fullname not in SUITE_FOLDERS:
            return None
        entries = [e for e in sys.path if isinstance(e, str)]
        checkouts = [_absolute(e) for e in entries if is_suite_checkout(_absolute(e))]
        if not checkouts:
            return None
        folders = [os.path.join(c, fullname) for c in dict.fromkeys(checkouts)]
        others = [e for e in entries if _absolute(e) not in checkouts]
        for finder in list(sys.meta_path):
            if finder is cls or getattr(finder, "find_spec", None) is None:
                continue
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(fullname, others)
            else:
                spec = finder.find_spec(fullname, None)
            if spec is not None and not _within(spec, folders):
                return spec
        raise ModuleNotFoundError(
            f"No module named {fullname!r} outside the suite's checkout: {folders[0]} is the suite's own "
            f"conformance.{fullname}, never the top-level {fullname!r} (import conformance.{fullname} for it). "
            f"If your own {fullname!r} package is meant, install it or put its directory on PYTHONPATH.",
            name=fullname)


def install() -> None:
    """Put :class:`CheckoutGuard` first on ``sys.meta_path`` (once)."""
    if CheckoutGuard not in sys.meta_path:
        sys.meta_path.insert(0, CheckoutGuard)
