"""The known-failures list: failures that are real findings, expected and explained.

The file is TOML, one ``[[failure]]`` table per entry::

    [[failure]]
    test = ["test_parity[fp16_compress_hook-*]"] # test-name patterns ('*' is the only wildcard);
                                                # a single string works too
    hook = "fp16_compress_hook"                 # the hook it concerns (optional)
    reason = "record_stream on a CPU tensor raises in default_hooks._decompress"
    device = "cpu"                              # optional conditions: backend, device,
    backend = "gloo"                            # torch (a PEP 440 specifier, e.g. ">=2.13")
    torch = ">=2.13"
    run = false                                 # optional: do not even run it (it deadlocks
                                                # or kills a rank); reported as XFAIL unrun

A matching test is reported as an expected failure with its reason and does
not fail the run; if it passes, it is flagged. An entry that applies to this
machine but matches no collected test is warned about, so the file never rots.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Dict, Iterable, List, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

__all__ = ["KnownFailure", "KnownFailureBook", "KnownFailuresError", "RunEnvironment", "load_known_failures"]

_KEYS = {"test", "reason", "hook", "backend", "device", "torch", "run"}


class KnownFailuresError(ValueError):
    """The known-failures file is malformed; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What an entry's conditions are matched against."""

    backend: str
    device: str
    torch_version: str


@dataclasses.dataclass(frozen=True)
class KnownFailure:
    """One expected failure.

    Attributes:
        test: patterns over test names such as ``test_parity[hook-FULL_SHARD-net_wrapped-ws2]``;
            ``*`` matches any run of characters, everything else is literal.
        reason: why it fails, shown in the report.
        source: ``file#index`` of the entry, for messages.
        run: ``False`` for a case that deadlocks or kills a rank: it is reported
            as an expected failure without being run (pytest's ``xfail(run=False)``).
    """

    test: Tuple[str, ...]
    reason: str
    source: str
    hook: Optional[str] = None
    backend: Optional[str] = None
    device: Optional[str] = None
    torch: Optional[str] = None
    run: bool = True

    def __post_init__(self) -> None:
        tests = (self.test,) if isinstance(self.test, str) else tuple(self.test)
        object.__setattr__(self, "test", tests)
        regexes = [".*".join(re.escape(part) for part in pattern.split("*")) for pattern in tests]
        object.__setattr__(self, "_regex", re.compile("^(?:" + "|".join(regexes) + ")$"))

    def matches(self, test_name: str) -> bool:
        """Whether a pattern matches the whole test name (or the tail of a node id)."""
        name = test_name.rsplit("::", 1)[-1]
        return bool(self._regex.match(name))  # type: ignore[attr-defined]

    def applies(self, env: RunEnvironment) -> bool:
        """Whether the entry's conditions hold on this run."""
        if self.backend is not None and self.backend != env.backend:
            return False
        if self.device is not None and self.device != env.device:
            return False
        if self.torch is not None:
            version = Version(Version(env.torch_version).base_version)
            if not SpecifierSet(self.torch).contains(version, prereleases=True):
                return False
        return True

    def conditions(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("backend", "device", "torch") if getattr(self, k)]
        return ", ".join(parts) or "always"


def load_known_failures(path: str) -> List[KnownFailure]:
    """Parse a known-failures TOML file.

    Raises:
        KnownFailuresError: unreadable file, bad TOML, unknown keys, missing
            ``test``/``reason``, or an invalid ``torch`` specifier.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise KnownFailuresError(f"cannot read known-failures file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KnownFailuresError(f"known-failures file {path} is not valid TOML: {exc}") from None
    extra = set(data) - {"failure"}
    if extra:
        raise KnownFailuresError(f"{path}: unknown top-level keys {sorted(extra)}; entries go in [[failure]] tables")
    entries = []
    failures = data.get("failure", [])
    if not isinstance(failures, list):
        raise KnownFailuresError(f"{path}: 'failure' must be an array of tables: write each entry as [[failure]]")
    for i, raw in enumerate(failures):
        where = f"{path}#failure[{i}]"
        if not isinstance(raw, dict):
            raise KnownFailuresError(f"{where}: each entry must be a table; write it as [[failure]] with keys")
        if "run" in raw and not isinstance(raw["run"], bool):
            raise KnownFailuresError(f"{where}: run = {raw['run']!r} must be true or false")
        for key in ("hook", "backend", "device", "torch"):
            if key in raw and not isinstance(raw[key], str):
                raise KnownFailuresError(f"{where}: {key} = {raw[key]!r} must be a string (quote it, "
                                         f"e.g. {key} = \"{raw[key]}\")")
        unknown = set(raw) - _KEYS
        if unknown:
            raise KnownFailuresError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        if not isinstance(raw.get("reason"), str) or not raw["reason"].strip():
            raise KnownFailuresError(f"{where}: 'reason' is required and must be a non-empty string")
        tests = raw.get("test")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise KnownFailuresError(f"{where}: 'test' is required: a test-name pattern or a list of them, "
                                     "e.g. test = \"test_parity[my_hook-*]\"")
        raw = {**raw, "test": tuple(tests)}
        if "torch" in raw:
            try:
                SpecifierSet(raw["torch"])
            except InvalidSpecifier:
                raise KnownFailuresError(f"{where}: torch = {raw['torch']!r} is not a version specifier "
                                         "such as '>=2.13' or '==2.13.*'") from None
        entries.append(KnownFailure(source=where, **raw))
    return entries


class KnownFailureBook:
    """The entries that apply to this run, and which of them matched a test."""

    def __init__(self, entries: Iterable[KnownFailure], env: RunEnvironment):
        self.env = env
        self.entries = [e for e in entries if e.applies(env)]
        self.used: Dict[str, int] = {}

    def lookup(self, test_name: str) -> Optional[KnownFailure]:
        for entry in self.entries:
            if entry.matches(test_name):
                self.used[entry.source] = self.used.get(entry.source, 0) + 1
                return entry
        return None

    def unused(self, hooks_under_test: Optional[Iterable[str]] = None) -> List[KnownFailure]:
        """Entries that matched nothing; with ``hooks_under_test``, only those about such hooks."""
        hooks = None if hooks_under_test is None else set(hooks_under_test)
        return [e for e in self.entries if e.source not in self.used
                and (hooks is None or e.hook is None or e.hook in hooks)]

