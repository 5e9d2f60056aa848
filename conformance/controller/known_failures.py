"""The known-failures list: failures that are real findings, expected and explained.

The file is TOML, one ``[[failure]]`` table per entry::

    [[failure]]
    test = ["test_parity[fp16_compress_hook-*]"] # test-name patterns ('*' is the only wildcard);
                                                # a single string works too
    hook = "fp16_compress_hook"                 # the hook it concerns (optional)
    reason = "record_stream on a CPU tensor raises in default_hooks._decompress"
    device = "cpu"                              # optional conditions: backend, device,
    backend = "gloo"                            # torch (a PEP 440 specifier, e.g. ">=2.13"),
    torch = ">=2.13"                            # cuda_build (whether torch was built with
    cuda_build = false                          # CUDA or ROCm: torch.version.cuda/hip)
    run = false                                 # optional: do not even run it (it deadlocks
                                                # or kills a rank); reported as XFAIL unrun
    min_world_size = 2                          # optional: only cases of at least this many
                                                # ranks (a cross-rank bug passes at 1)
    sample = true                               # optional: the failure does not depend on the
                                                # case (a refused registration, a raise on the
                                                # CPU): one case per suite test and world size
                                                # runs; the others are reported as XFAIL unrun

A matching test is reported as an expected failure with its reason and does
not fail the run; if it passes, it is flagged. An entry that could apply to this
run but matches no collected test is warned about, so the file never rots. An
entry could apply where its conditions hold (:meth:`KnownFailure.applies`) and,
when every pattern of it names a world size (``...-ws3]``), where the run has
cases of one of those world sizes: an entry about 3 ranks is not stale in a run
with ``--extra-world-size 0``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from conformance import fixtures

__all__ = ["KnownFailure", "KnownFailureBook", "KnownFailuresError", "RunEnvironment", "load_known_failures"]

_KEYS = {"test", "reason", "hook", "backend", "device", "torch", "cuda_build", "run", "min_world_size", "sample"}
_WORLD_SIZE_AT_END = re.compile(r"-ws(\d+)\]$")


class KnownFailuresError(ValueError):
    """The known-failures file is malformed; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What an entry's conditions are matched against.

    Attributes:
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"``.
        torch_version: ``torch.__version__``.
        cuda_build: whether torch was built with CUDA or ROCm
            (``torch.version.cuda`` or ``torch.version.hip`` is set), GPU or not.
            Some PyTorch behaviour depends on the build, not the device: DDP's
            ``_check_comm_hook`` refuses the bf16 hooks on a build without CUDA.
    """

    backend: str
    device: str
    torch_version: str
    cuda_build: bool = False

    @classmethod
    def of_this_process(cls, backend: str, device: str) -> "RunEnvironment":
        """The environment of the imported torch, on ``backend``/``device``."""
        cuda_build = getattr(torch.version, "cuda", None) is not None or getattr(torch.version, "hip", None) is not None
        return cls(backend=backend, device=device, torch_version=torch.__version__, cuda_build=cuda_build)


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
        min_world_size: where set, a case whose id names fewer ranks (``-ws1]``) does not match: a bug
            between ranks (a hook that never communicates) passes at one rank, which a one-GPU machine runs.
        sample: the failure does not depend on the case (DDP refuses the hook at registration; the hook raises
            on the CPU whatever it reduces): the first matching case of each suite test and world size runs,
            and shows whether the failure still holds; the others are reported as expected failures without
            being run (each would cost a pool dispatch and a model build to fail the same way).
    """

    test: Tuple[str, ...]
    reason: str
    source: str
    hook: Optional[str] = None
    backend: Optional[str] = None
    device: Optional[str] = None
    torch: Optional[str] = None
    cuda_build: Optional[bool] = None
    run: bool = True
    min_world_size: Optional[int] = None
    sample: bool = False

    def __post_init__(self) -> None:
        tests = (self.test,) if isinstance(self.test, str) else tuple(self.test)
        object.__setattr__(self, "test", tests)
        regexes = [".*".join(re.escape(part) for part in pattern.split("*")) for pattern in tests]
        object.__setattr__(self, "_regex", re.compile("^(?:" + "|".join(regexes) + ")$"))

    def matches(self, test_name: str) -> bool:
        """Whether a pattern matches the whole test name (or the tail of a node id)."""
        name = test_name.rsplit("::", 1)[-1]
        if self.min_world_size is not None:
            found = _WORLD_SIZE_AT_END.search(name)
            if found is not None and int(found.group(1)) < self.min_world_size:
                return False
        return bool(self._regex.match(name))  # type: ignore[attr-defined]

    def world_sizes(self) -> Optional[FrozenSet[int]]:
        """The world sizes the patterns can match, or ``None`` (any) where a pattern does not end in
        ``-ws<N>]``, the world size of a case id (:func:`conformance.cases.case_id`)."""
        sizes = set()
        for pattern in self.test:
            found = _WORLD_SIZE_AT_END.search(pattern)
            if found is None:
                return None
            sizes.add(int(found.group(1)))
        return frozenset(sizes)

    def applies(self, env: RunEnvironment) -> bool:
        """Whether the entry's conditions hold on this run."""
        if self.backend is not None and self.backend != env.backend:
            return False
        if self.device is not None and self.device != env.device:
            return False
        if self.cuda_build is not None and self.cuda_build != env.cuda_build:
            return False
        if self.torch is not None:
            version = Version(Version(env.torch_version).base_version)
            if not SpecifierSet(self.torch).contains(version, prereleases=True):
                return False
        return True

    def conditions(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("backend", "device", "torch") if getattr(self, k)]
        if self.cuda_build is not None:
            parts.append(f"cuda_build={str(self.cuda_build).lower()}")
        return ", ".join(parts) or "always"


def display_path(path: str) -> str:
    """How messages name a known-failures file: the packaged one by its path in the
    repository (``fixtures/known_failures.toml``), another one relative to the working
    directory when it lies below it, else as given."""
    full = os.path.abspath(path)
    packaged = os.path.dirname(os.path.abspath(fixtures.__file__))
    if os.path.dirname(full) == packaged:
        return f"fixtures/{os.path.basename(full)}"
    rel = os.path.relpath(full)
    return path if rel.startswith(os.pardir) else rel


def load_known_failures(path: str) -> List[KnownFailure]:
    """Parse a known-failures TOML file (UTF-8, as TOML requires).

    Raises:
        KnownFailuresError: unreadable file, a file that is not UTF-8, bad
            TOML, unknown keys, missing ``test``/``reason``, or an invalid
            ``torch`` specifier.
    """
    shown = display_path(path)
    try:
        with open(path, "rb") as f:
            raw_bytes = f.read()
    except OSError as exc:
        raise KnownFailuresError(f"cannot read known-failures file {shown}: {exc}") from None
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw_bytes[:exc.start].count(b"\n") + 1
        raise KnownFailuresError(
            f"known-failures file {shown} is not UTF-8 (byte 0x{raw_bytes[exc.start]:02x} on line {line}); "
            "TOML files must be UTF-8: re-save it as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KnownFailuresError(f"known-failures file {shown} is not valid TOML: {exc}") from None
    path = shown
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
        for flag in ("run", "sample"):
            if flag in raw and not isinstance(raw[flag], bool):
                raise KnownFailuresError(f"{where}: {flag} = {raw[flag]!r} must be true or false")
        if "min_world_size" in raw and (type(raw["min_world_size"]) is not int or raw["min_world_size"] < 1):
            raise KnownFailuresError(f"{where}: min_world_size = {raw['min_world_size']!r} must be a whole number "
                                     "of ranks, at least 1")
        if "cuda_build" in raw and not isinstance(raw["cuda_build"], bool):
            raise KnownFailuresError(f"{where}: cuda_build = {raw['cuda_build']!r} must be true or false")
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

    def __init__(self, entries: Iterable[KnownFailure], env: RunEnvironment,
                 placements: Optional[Dict[int, Tuple[str, str]]] = None):
        """``env`` is the run's (its main world size's backend and device); ``placements`` maps a world size
        whose pool runs elsewhere to its ``(backend, device)`` (``Settings.placement``: a one-GPU machine's
        cross-rank pools run gloo on the CPU), so a case is matched against the backend and device its
        ranks use, read from the ``-ws<N>]`` of its id."""
        self.env = env
        self.envs = {ws: dataclasses.replace(env, backend=b, device=d) for ws, (b, d) in (placements or {}).items()}
        every = [env, *self.envs.values()]
        self.entries = [e for e in entries if any(e.applies(where) for where in every)]
        self.used: Dict[str, int] = {}

    def env_of(self, test_name: str) -> RunEnvironment:
        """The environment a case runs in: its world size's placement, else the run's."""
        found = _WORLD_SIZE_AT_END.search(test_name)
        return self.envs.get(int(found.group(1)), self.env) if found else self.env

    def lookup(self, test_name: str) -> Optional[KnownFailure]:
        """The first entry that matches ``test_name`` where its case runs (:meth:`env_of`); every matching
        entry counts as used (a later entry can cover the same test on another build, e.g. ``cuda_build``)."""
        found = None
        env = self.env_of(test_name)
        for entry in self.entries:
            if entry.applies(env) and entry.matches(test_name):
                self.used[entry.source] = self.used.get(entry.source, 0) + 1
                found = found or entry
        return found

    def unused(self, hooks_under_test: Optional[Iterable[str]] = None,
               world_sizes: Optional[Iterable[int]] = None) -> List[KnownFailure]:
        """Entries that matched nothing and could have: with ``hooks_under_test``, only those about such
        hooks; with ``world_sizes`` (of the run's cases), only those whose patterns can match one of them
        (:meth:`KnownFailure.world_sizes`)."""
        hooks = None if hooks_under_test is None else set(hooks_under_test)
        sizes = None if world_sizes is None else set(world_sizes)
        return [e for e in self.entries if e.source not in self.used
                and (hooks is None or e.hook is None or e.hook in hooks)
                and (sizes is None or e.world_sizes() is None or bool(e.world_sizes() & sizes))]

