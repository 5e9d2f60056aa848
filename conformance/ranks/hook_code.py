"""Which of the hook's own Python code ran on this rank: branch coverage by coverage.py, traced only while the
hook's code runs (rank side, one meter per process).

A verdict must say what of the hook it exercised: a hook whose other path needs a warm-up *and* a large buffer
passes every case that never takes that path. Every API's recorder (the wrapper around the hook under test)
runs each call of the hook's code inside :func:`running` (``with hook_code.running(hook): hook(...)``), and
so does the build of its state; the meter starts a ``coverage.Coverage`` (branch coverage, in memory) for the
length of the call and stops it after, so the tracer never sees FSDP's, DDP's or the suite's own Python between
two calls. The worker starts the meter for each case (:func:`start`) and sends what it read (:func:`read`) with
the case's outcome; the controller merges the ranks' data of every case of a hook
(:mod:`conformance.reports.hook_code`).

What is traced: the files of the hook's own package (the top-level package of the module that defines the hook,
its state factory or the class of its comm, or the directory of a module that is in no package); where that
module is PyTorch's or the suite's own (PyTorch's built-in hooks), the file that defines it alone. Never
PyTorch's, the suite's, the standard library's or an installed package's other files. What is reported of the
traced files is decided by the controller: the hook's own definitions (its :data:`Roots`) and every function
that ran.

Collecting it changes no result: nothing the hook's code sees is replaced (coverage.py sets a trace function on
the calling thread for the length of the call). A future's callback that gloo runs on its own threads is not
traced (``sys.settrace`` is per thread before Python 3.12): the controller reports those callbacks as not
measured.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sysconfig
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Set, Tuple, Union

if TYPE_CHECKING:  # pragma: no cover
    from types import FunctionType

    from torch.distributed import ProcessGroup

    from conformance.spec import HookSpec

__all__ = ["read", "root_of", "running", "start", "state_of", "trace_path"]

#: ``(file, qualname)`` of a definition of the hook's: a function, or a class (all of its methods).
Root = Tuple[str, str]

_SUITE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _dirs_of(module_name: str) -> List[str]:
    spec = None
    try:
        import importlib.util

        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return []
    return [os.path.realpath(p) for p in (getattr(spec, "submodule_search_locations", None) or [])]


#: Where no hook's package lies: PyTorch's and the suite's own trees, the standard library and installed packages.
_FOREIGN = tuple(sorted({*_dirs_of("torch"), _SUITE_DIR,
                         *(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                                                  "platlib"))}))


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _foreign(path: str) -> bool:
    return any(_under(path, folder) for folder in _FOREIGN)


@functools.lru_cache(maxsize=None)
def trace_path(path: str) -> str:
    """What to trace for a definition in ``path`` (a ``.py`` file): the directory of its top-level package (walked
    up while a folder holds ``__init__.py``), or of its module where that is in no package; ``path`` itself where
    it is PyTorch's or the suite's own file, or a module installed on its own (in site-packages or the standard
    library). A directory ends in ``os.sep``."""
    path = os.path.realpath(path)
    if any(_under(path, folder) for folder in (*_dirs_of("torch"), _SUITE_DIR)):
        return path
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(os.path.dirname(folder), "__init__.py")) and \
            os.path.isfile(os.path.join(folder, "__init__.py")):
        folder = os.path.dirname(folder)
    if folder in _FOREIGN:
        return path
    return folder.rstrip(os.sep) + os.sep


def _unwrapped(obj: object) -> object:
    for _ in range(16):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif inspect.ismethod(obj):
            obj = obj.__func__
        elif hasattr(obj, "__wrapped__") and callable(obj):
            obj = obj.__wrapped__
        else:
            break
    return obj


def root_of(obj: object) -> Optional[Root]:
    """``obj`` (a hook, a state factory, a comm object) as the definition it runs: a function (through
    ``functools.partial``, bound methods and ``functools.wraps``), or the class of an object; ``None`` where
    it has no Python source (a C++ or compiled hook)."""
    obj = _unwrapped(obj)
    target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    try:
        return _root_of_definition(target)
    except TypeError:  # unhashable: not a function or class after all
        return None


@functools.lru_cache(maxsize=256)
def _root_of_definition(target: Union[type, FunctionType]) -> Optional[Root]:
    try:
        path = inspect.getsourcefile(target)
    except (TypeError, OSError):
        return None
    if not path or not path.endswith(".py"):
        return None
    return os.path.realpath(path), getattr(target, "__qualname__", getattr(target, "__name__", "?"))


class _SpecMeter:
    """What one hook's code ran in this process: its ``coverage.Coverage`` (one per hook, so that a replay of
    another hook in the same ranks adds nothing to it), the paths it traces, its arcs and what was sent."""

    def __init__(self) -> None:
        self.cov: Any = None
        self.paths: Set[str] = set()
        self.carried: Dict[str, Set[Tuple[int, int]]] = {}  # what an earlier coverage object of this hook recorded
        self.sent: Dict[str, Set[Tuple[int, int]]] = {}
        self.roots: Set[Root] = set()

    def arcs(self) -> Dict[str, Set[Tuple[int, int]]]:
        """Every arc the hook's code ran in this process so far (the coverage object is never erased: making it
        ready to trace again costs tens of milliseconds, a case of hundreds of calls costs that a call)."""
        out = {path: set(arcs) for path, arcs in self.carried.items()}
        if self.cov is not None:
            data = self.cov.get_data()
            for path in data.measured_files():
                out.setdefault(path, set()).update(data.arcs(path) or ())
        return out

    def coverage_for(self, path: str) -> Any:
        """The coverage object that traces ``path`` (a file, or a directory ending in ``os.sep``), made anew with
        it added where it traced other paths only (what the old one recorded is carried over)."""
        if path in self.paths and self.cov is not None:
            return self.cov
        import coverage

        self.carried = self.arcs()
        self.paths.add(path)
        include = sorted(p + "*" if p.endswith(os.sep) else p for p in self.paths)
        omit = [f.rstrip(os.sep) + os.sep + "*" for f in _FOREIGN]
        self.cov = coverage.Coverage(data_file=None, branch=True, config_file=False, include=include,
                                     omit=[o for o in omit if not any(i.startswith(o[:-1]) for i in include)])
        self.cov.set_option("run:disable_warnings", list(_QUIET))
        return self.cov


class _Meter:
    """The process's meter: the case's hook (:class:`_SpecMeter`), whether it is measured, and why not."""

    def __init__(self) -> None:
        self.enabled = False
        self.hooks: Dict[Tuple[str, str], _SpecMeter] = {}
        self.current: Optional[_SpecMeter] = None
        self.problem: Optional[str] = None
        self.reported = False  # the hook is not Python: say so, though nothing is traced
        self.lock = threading.Lock()
        self.busy = False


_METER = _Meter()
#: coverage.py's warnings that say nothing here: a case whose hook ran no traced code, a tracer the hook changed.
_QUIET = ("no-data-collected", "module-not-measured", "module-not-imported", "trace-changed", "already-imported",
          "include-ignored", "no-ctracer", "couldnt-parse")


def start(spec: HookSpec, enabled: bool = True) -> None:
    """A new case of ``spec``'s hook (``None``: no hook). ``enabled=False`` (``--hook-coverage off``): no tracing."""
    meter = _METER
    meter.enabled, meter.problem, meter.reported, meter.current = enabled and spec is not None, None, False, None
    if not meter.enabled:
        return
    not_python = getattr(spec.hook, "not_python", None)
    if not_python is None and root_of(spec.hook) is None:
        name = getattr(spec.hook, "__qualname__", type(spec.hook).__name__)
        not_python = f"{name} has no Python source (a C++ hook or a compiled extension)"
    if not_python is not None:
        meter.problem, meter.enabled, meter.reported = str(not_python), False, True
        return
    key = (getattr(spec, "name", "?"), repr(getattr(spec, "hook", None).__class__))
    meter.current = meter.hooks.setdefault(key, _SpecMeter())
    for obj in (spec.hook, getattr(spec, "state", None)):
        if obj is not None:
            _note(obj)


def _note(obj: object) -> Optional[Any]:
    root = root_of(obj)
    current = _METER.current
    if root is None or current is None:
        return None
    current.roots.add(root)
    try:
        return current.coverage_for(trace_path(root[0]))
    except ImportError:
        _METER.problem = "coverage.py is not installed here (pip install 'coverage>=7')"
        return None


@contextlib.contextmanager
def running(obj: object) -> Iterator[None]:
    """Trace the hook's code while the block runs (a call of ``obj``, the hook, its comm object or its state
    factory). Nested blocks and blocks on a second thread while one traces are not traced again."""
    meter = _METER
    if not meter.enabled:
        yield
        return
    with meter.lock:
        mine = not meter.busy
        meter.busy = True
    if not mine:
        yield
        return
    cov = None
    try:
        cov = _note(obj)
        if cov is not None:
            cov.start()
    except Exception as exc:  # noqa: BLE001 - measuring must never fail the hook: say why it is missing
        meter.problem, cov = f"coverage.py could not trace the hook's code here ({type(exc).__name__}: {exc})", None
    try:
        yield
    finally:
        if cov is not None:
            cov.stop()
        meter.busy = False


def read() -> Dict[str, Any]:
    """What ran since the last read of this hook in this process: ``{"arcs": {file: [[from, to], ...]}, "roots":
    [[file, qualname], ...], "problem": why nothing could be measured, or None}`` (plain data, for the wire; the
    controller merges every case's); ``{}`` where the meter is off."""
    meter, current = _METER, _METER.current
    if not meter.enabled or current is None:
        return {"arcs": {}, "roots": [], "problem": meter.problem} if meter.reported else {}
    new = {}
    for path, arcs in current.arcs().items():
        fresh = arcs - current.sent.get(path, set())
        if fresh:
            new[path] = sorted([a, b] for a, b in fresh)
            current.sent.setdefault(path, set()).update(fresh)
    return {"arcs": new, "roots": sorted([path, name] for path, name in current.roots), "problem": meter.problem}


def state_of(spec: HookSpec, group: Optional[ProcessGroup]) -> Any:
    """``spec.state(group)``, the hook's state built with its factory's code traced (``None`` for a stateless
    API's spec)."""
    if getattr(spec, "state", None) is None:
        return None
    with running(spec.state):
        return spec.state(group)
