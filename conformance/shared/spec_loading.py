"""Finding the hooks under test: ``module:ATTR`` targets and the ``conformance.hooks`` entry points.

``ATTR`` names one :class:`~conformance.spec.HookSpec` or a list/tuple of them.
Installed packages offer specs through the entry-point group
``conformance.hooks`` (each entry point's value is a ``module:ATTR`` target).
Every error is a :class:`~conformance.signatures.SpecError` raised before any rank
process is spawned, and its message says what to fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from importlib import metadata
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from conformance.shared import suite_checkout
from conformance.apis.registry import HOOK_APIS
from conformance.spec import HookSpec
from conformance.signatures import SpecError

__all__ = ["BUILTIN_TARGETS", "ENTRY_POINT_GROUP", "LoadedSpec", "load_specs", "load_target", "pythonpath_to_rerun"]

ENTRY_POINT_GROUP = "conformance.hooks"
#: PyTorch's own hooks, tested when no ``--hook`` is given (and with ``--with-builtins``):
#: each hook API's built-in set (:data:`conformance.apis.registry.HOOK_APIS`).
BUILTIN_TARGETS = tuple(dict.fromkeys(api.builtin_hooks for api in HOOK_APIS.values() if api.builtin_hooks))


@dataclasses.dataclass(frozen=True)
class LoadedSpec:
    """A spec and the ``module:ATTR`` target it came from (ranks re-load it from there)."""

    target: str
    spec: HookSpec
    origin: str = "--hook"


def load_target(target: str) -> List[HookSpec]:
    """Import ``module:ATTR`` and return its specs.

    Raises:
        SpecError: malformed target, module that cannot be imported, missing
            attribute, or an attribute that is not a HookSpec (or a list of them).
    """
    suite_checkout.install()  # in a rank too: a suite checkout on its sys.path never shadows the user's packages
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"hook target {target!r} is not of the form 'package.module:ATTR' "
                        "(e.g. --hook my_hooks.fp16:SPEC)")
    try:
        module = importlib.import_module(module_name)
    except SpecError as exc:
        raise SpecError(f"hook target {target!r}: importing {module_name!r} built a bad HookSpec: {exc}") from None
    except ImportError as exc:
        raise SpecError(
            f"hook target {target!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}). "
            "Install the package, or put its directory on PYTHONPATH (the rank processes need it too)."
        ) from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise SpecError(f"hook target {target!r}: importing {module_name!r} raised "
                        f"{type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            specs_there = sorted(n for n, v in vars(module).items() if _is_specs(v))
            hint = f" It defines HookSpecs under: {', '.join(specs_there)}." if specs_there else ""
            raise SpecError(f"hook target {target!r}: module {module_name!r} has no attribute {attr!r}.{hint}") from None
    if isinstance(obj, HookSpec):
        return [obj]
    if isinstance(obj, (list, tuple)) and all(isinstance(s, HookSpec) for s in obj):
        # An empty list is allowed: a package may offer no specs on some torch versions.
        return list(obj)
    raise SpecError(
        f"hook target {target!r} is {_describe(obj)}, not a HookSpec or a list of HookSpecs. Wrap your "
        "hook: SPEC = HookSpec(name='my_hook', api='fsdp', hook=my_hook, state=make_state, reduce_dtype=None)"
    )


def _is_specs(value: object) -> bool:
    return isinstance(value, HookSpec) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, HookSpec) for v in value))


def _describe(obj: object) -> str:
    if isinstance(obj, (list, tuple)):
        bad = [type(v).__name__ for v in obj if not isinstance(v, HookSpec)]
        return f"a {type(obj).__name__} holding {', '.join(bad) or 'nothing'}"
    if callable(obj):
        return f"the callable {getattr(obj, '__qualname__', type(obj).__name__)}"
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def entry_point_targets() -> List[str]:
    """``module:ATTR`` values of the installed ``conformance.hooks`` entry points."""
    eps = metadata.entry_points()
    if hasattr(eps, "select"):
        selected: Iterable = eps.select(group=ENTRY_POINT_GROUP)
    else:  # Python < 3.10
        selected = eps.get(ENTRY_POINT_GROUP, [])
    return sorted({ep.value.replace(" ", "") for ep in selected})


def load_specs(targets: Sequence[str], *, builtins: bool, entry_points: bool) -> List[LoadedSpec]:
    """All specs under test, in a stable order, with names checked for uniqueness.

    Raises:
        SpecError: any target fails to load, or two specs share a name.
    """
    wanted = [(t, "--hook") for t in targets]
    if builtins:
        wanted = [(t, "built-in") for t in BUILTIN_TARGETS] + wanted
    if entry_points:
        wanted += [(t, f"entry point group {ENTRY_POINT_GROUP!r}") for t in entry_point_targets()]
    loaded: List[LoadedSpec] = []
    seen: Dict[str, LoadedSpec] = {}
    done = set()
    for target, origin in wanted:
        if target in done:
            continue
        done.add(target)
        for spec in load_target(target):
            if spec.name in seen:
                first = seen[spec.name]
                raise SpecError(
                    f"two hooks are named {spec.name!r}: one from {first.target!r} ({first.origin}) and one "
                    f"from {target!r} ({origin}). Names appear in test ids and must be unique; rename one."
                )
            item = LoadedSpec(target, spec, origin)
            seen[spec.name] = item
            loaded.append(item)
    if not loaded:
        raise SpecError("no hooks to test: give --hook module:ATTR, or drop --no-builtins")
    return loaded


def user_paths_first() -> Tuple[str, ...]:
    """Put the working directory, then each ``PYTHONPATH`` entry, at the front of ``sys.path``.

    The controller calls this before it loads any spec and hands the result to
    every rank (:attr:`conformance.controller.pools.PoolConfig.sys_path`), so both resolve
    ``--hook my_pkg.hooks:SPEC`` alike, as ``python -m`` would from here. Paths
    are made absolute, so a rank started elsewhere finds the same files.

    A checkout of this suite among them (the working directory of ``make conform``,
    say) goes after the others, and its ``models/``, ``fixtures/`` and
    ``examples/`` folders never resolve as top-level packages
    (:mod:`conformance.shared.suite_checkout`): a user's ``models``, ``fixtures``,
    ``examples`` or ``tests`` package is never shadowed by the suite, whichever
    directory the run starts in. (The ranks install the same guard in
    :func:`load_target`.)

    Returns:
        the new ``sys.path``, as a tuple.
    """
    cwd = os.getcwd()
    wanted = [cwd] + [os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    front = suite_checkout.order_user_paths(wanted)
    rest = [p for p in sys.path if (os.path.abspath(p) if p else cwd) not in front]
    sys.path[:] = front + rest
    suite_checkout.install()
    importlib.invalidate_caches()
    return tuple(sys.path)


def pythonpath_to_rerun(*, cwd: Optional[str] = None, pythonpath: Optional[str] = None,
                        modules: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
    """The ``PYTHONPATH`` entries a fresh shell in ``cwd`` needs to import what this session imported.

    They are the entries of ``pythonpath`` (default: this process's
    ``PYTHONPATH``), made absolute as :func:`user_paths_first` makes them, from
    which a module of ``modules`` (default: ``sys.modules``) was loaded: the
    directory holding a hook module's top-level package, and any other entry the
    hook's own imports came from. Left out: ``cwd`` (default: the working
    directory; a re-run started there finds its modules there, as this session
    did) and entries no module came from. Order and duplicates follow
    ``pythonpath``, so the first entry that provided a module still wins.

    Returns:
        absolute directory paths, possibly none.
    """
    cwd = os.path.abspath(cwd or os.getcwd())
    raw = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    entries = [e for e in dict.fromkeys(os.path.abspath(p) for p in raw.split(os.pathsep) if p) if e != cwd]
    if not entries:
        return ()
    files = []
    for module in list((sys.modules if modules is None else modules).values()):
        location = getattr(module, "__file__", None)
        if isinstance(location, str):
            files.append(os.path.abspath(location))
        else:  # a namespace package has only __path__
            files += [os.path.abspath(p) for p in getattr(module, "__path__", None) or () if isinstance(p, str)]
    return tuple(e for e in entries if any(_is_within(f, e) for f in files))


def _is_within(path: str, directory: str) -> bool:
    try:
        return os.path.commonpath([path, directory]) == directory
    except ValueError:  # different drives (Windows)
        return False
