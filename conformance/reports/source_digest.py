"""Which build of the suite wrote a results document: a digest of the files that decide a run's outcomes.

A results file says which suite version wrote it (``suite.version``), but a version is not bumped for every
change, and a checkout's edits change outcomes without one. :func:`source_digest` hashes the files the run's
outcomes come from: the ``conformance`` package (the checks, the plans, the diagnosis), the reference models
(``conformance.models``) and the packaged fixtures (``conformance.fixtures``: the known failures). The results
document carries it as ``suite.source_digest`` (``docs/results.md``), so a reader can tell whether two results
files came from the same suite, and whether one came from the code it has now.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from typing import Iterable, Iterator, Sequence, Tuple

__all__ = ["SOURCE_PACKAGES", "SOURCE_SUFFIXES", "source_digest", "source_files"]

#: The packages whose files decide a run's outcomes (``conformance.examples`` does not: the examples run only
#: when named with ``--hook``, and a hook's own files are not the suite's).
SOURCE_PACKAGES = ("conformance", "conformance.models", "conformance.fixtures")
#: The files of those packages that count: code, the packaged TOML and JSON, the suite's pytest.ini.
SOURCE_SUFFIXES = (".py", ".toml", ".json", ".ini")


def _walk(directory: str, skip: Sequence[str]) -> Iterator[str]:
    for root, dirs, files in os.walk(directory):
        # a non-editable install nests the other packages inside conformance/: each is read once, as itself
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.join(root, d) not in skip)
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                yield os.path.join(root, name)


def source_files(packages: Iterable[str] = SOURCE_PACKAGES) -> Iterator[Tuple[str, str]]:
    """``(key, path)`` of every file of ``packages`` that counts (:data:`SOURCE_SUFFIXES`), in a fixed order;
    ``key`` is the package and the path within it (``conformance.models/nested.py``), the same in an editable
    and in a regular install.

    Raises:
        ImportError: a package of ``packages`` cannot be imported.
    """
    packages = list(packages)
    roots = {name: [os.path.abspath(p) for p in importlib.import_module(name).__path__] for name in packages}
    nested = [root for name in packages for root in roots[name]]
    for name in packages:
        for root in roots[name]:
            others = [r for r in nested if r != root and r.startswith(root + os.sep)]
            for path in _walk(root, others):
                yield f"{name}/{os.path.relpath(path, root).replace(os.sep, '/')}", path


def source_digest(packages: Iterable[str] = SOURCE_PACKAGES) -> str:
    """SHA-256 (the first 16 hex digits) of the names and bytes of :func:`source_files`: the same for two runs of
    the same suite files, whatever the install, and different once any of them changes (a file edited, added,
    removed or renamed).

    Raises:
        ImportError: as :func:`source_files`; OSError: a file cannot be read.
    """
    digest = hashlib.sha256()
    for key, path in source_files(packages):
        with open(path, "rb") as f:
            content = f.read()
        digest.update(key.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
    return digest.hexdigest()[:16]
