"""Fixtures shared by the project's tests.

``zoo_runs``: each meta-run (``tests/meta_zoos/``), and each other background job a test module names
(:class:`~tests.meta_helpers.BackgroundJob`), once per pytest session, shared by every test that needs it,
whatever its file: a zoo run costs minutes on a 2-core machine. Once the tests are collected,
the runs they will need start in the background (:meth:`~tests.meta_helpers.ZooRuns.prefetch`), in the
order the tests need them, and those tests run last.

Kinds: every test is marked with its module's kind (``tests/kinds.py``: ``unit``, ``cli``, ``ranks``, ``suite``,
``meta``, and ``torchrun`` besides), so ``pytest -m unit`` (``make test-fast``) runs the unit tests alone; a module
that ``tests/kinds.py`` does not name stops the collection.

``gloo_group`` and ``fsdp1``: a single-rank gloo process group in this process, and the FSDP1 builds of the reference
models over it (``tests/test_models_fsdp.py``, ``tests/test_models_extra.py``; ``gloo_group`` also
``tests/test_reference_replay.py``).
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path
from typing import Iterator, List

import pytest
import torch.distributed as dist

from tests.kinds import KINDS, MODULES
from tests.meta_helpers import BackgroundJob, MetaZoo, ZooRuns
from tests.model_helpers import Fsdp1Builds

TESTS = Path(__file__).resolve().parent

_ZOO_RUNS = pytest.StashKey[ZooRuns]()


def _zoo_runs(config: pytest.Config) -> ZooRuns:
    if _ZOO_RUNS not in config.stash:
        factory = getattr(config, "_tmp_path_factory", None)  # the tmp_path_factory fixture's, --basetemp and all
        if factory is not None:
            # Made here, in the main thread, before any zoo run's thread asks for a directory under it: pytest makes
            # it on first use, unlocked, so a test's tmp_path and a background run making it at once got two
            # different ones, and the run's mktemp refused its name ("not a normalized and relative path").
            factory.getbasetemp()
        config.stash[_ZOO_RUNS] = ZooRuns(lambda name: str(factory.mktemp(name)) if factory is not None
                                          else tempfile.mkdtemp(prefix=f"{name}-"))
    return config.stash[_ZOO_RUNS]


def _reads_a_zoo(item: pytest.Item) -> bool:
    return "zoo_runs" in getattr(item, "fixturenames", ())


def zoos_needed(items: List[pytest.Item]) -> List[MetaZoo]:
    """The zoo runs ``items`` will ask ``zoo_runs`` for, in the order they first need them: a test's own
    ``zoo`` parameter, else every zoo its module names (a ``test_meta_<api>.py`` module's fixture); and the
    background jobs its module names."""
    out: List[MetaZoo] = []
    for item in filter(_reads_a_zoo, items):
        params = getattr(getattr(item, "callspec", None), "params", {})
        jobs = [v for v in vars(item.module).values() if isinstance(v, BackgroundJob)]
        if isinstance(params.get("zoo"), MetaZoo):
            found = [params["zoo"], *jobs]
        else:
            found = [v for v in vars(item.module).values() if isinstance(v, (MetaZoo, BackgroundJob))]
        out.extend(z for z in found if z not in out)
    return out


def _module(item: pytest.Item) -> str:
    """``test_x`` for an item of ``tests/test_x.py``; ``""`` for one outside ``tests/`` (or in a folder below it)."""
    path = Path(str(item.path)).resolve()
    return path.stem if path.parent == TESTS else ""


def mark_kinds(items: List[pytest.Item]) -> None:
    """Mark each item of ``tests/`` with its module's kind and extras (``tests/kinds.py``), unless it carries a kind
    of its own.

    Raises:
        pytest.UsageError: a module that ``tests/kinds.py`` does not name, a test with two kinds, or a test that
            reads a zoo run (the ``zoo_runs`` fixture) under a kind that promises no run of the suite.
    """
    unnamed = sorted({_module(item) for item in items} - set(MODULES) - {""})
    if unnamed:
        raise pytest.UsageError(f"tests/kinds.py names no kind for {', '.join(unnamed)}: add each to MODULES with one "
                                f"of {', '.join(KINDS)} (tests/kinds.py says what each means)")
    for item in items:
        if not _module(item):
            continue
        kind, *extras = MODULES[_module(item)]
        own = {mark.name for mark in item.iter_markers() if mark.name in KINDS}
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked with two kinds: {', '.join(sorted(own))}")
        if not own:
            item.add_marker(kind)
        for extra in extras:
            item.add_marker(extra)
        if _reads_a_zoo(item) and (own or {kind}) & {"unit", "cli", "ranks"}:
            raise pytest.UsageError(f"{item.nodeid} reads a zoo run (zoo_runs) but is marked "
                                    f"{', '.join(own or {kind})}: a run of the suite is kind suite or meta")


@pytest.hookimpl(tryfirst=True)  # before pytest's -m and -k deselect by the marks
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: List[pytest.Item]) -> None:
    """Each test marked with its kind (:func:`mark_kinds`). The tests that read a zoo run go last (in their order),
    so the others keep the cores busy while the zoo runs go on in the background, instead of waiting for a run
    midway."""
    mark_kinds(items)
    items[:] = [item for item in items if not _reads_a_zoo(item)] + [item for item in items if _reads_a_zoo(item)]


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        _zoo_runs(session.config).prefetch(zoos_needed(session.items))
    # torch, the suite and the collected tests live for the whole session: out of the cyclic collector's sight,
    # as the suite's controller does (conformance/controller/pytest_plugin.py).
    gc.freeze()


@pytest.fixture(scope="session")
def zoo_runs(pytestconfig) -> ZooRuns:
    """``zoo_runs(zoo)``: the :class:`~tests.meta_helpers.SuiteRun` of a :class:`~tests.meta_helpers.MetaZoo`."""
    return _zoo_runs(pytestconfig)


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory) -> Iterator[dist.ProcessGroup]:
    """The default process group of this process, gloo over a file store, world size 1; made for the module and
    destroyed after it (one already made, of world size 1, is used and left alone). Skips where torch.distributed
    has no gloo, or where a default group of several ranks is already made."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    created = False
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("a multi-rank default process group is already initialized")
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp1(gloo_group) -> Fsdp1Builds:
    """FSDP1 builds of the reference models on :func:`gloo_group` (:class:`~tests.model_helpers.Fsdp1Builds`)."""
    return Fsdp1Builds(gloo_group)
