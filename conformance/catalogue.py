"""The check catalogue: every shared check declared once, as data both the controller and the ranks read.

A shared check is one rank function written over the API-neutral
:class:`~conformance.ranks.checks.models.ApiModels` (it registers itself under its entry's name with
:func:`conformance.ranks.checks.common.shared_check`). Its :class:`CheckEntry` here says the rest, for every
part of the suite at once:

* how a case of it runs on the controller (:attr:`CheckEntry.kind`, one of :data:`CASE_KINDS`);
* how it trains, which its rank function takes as keyword defaults and a reproducer copies into its ``CASE``
  (:attr:`CheckEntry.training`; ``None``: no reproducer);
* whether a failure can be replayed with the reference alone or with PyTorch's default hook
  (:attr:`CheckEntry.replay_reference`, :attr:`CheckEntry.replay_default_hook`), which the controller's
  attribution reads (:mod:`conformance.controller.replays`);
* which of the suite's cases it has: either each API plans its own suite tests of it (the averaging, parity,
  long run, ... in ``conformance/apis/<api>/plan.py``), or the catalogue plans them
  (:attr:`CheckEntry.catalogued`): then every API of :attr:`CheckEntry.apis` has a suite test
  ``test_<api>_<name>`` (FSDP1's ``test_<name>``) of the specs it is for (:attr:`CheckEntry.claims`), at
  :attr:`CheckEntry.world_sizes`, on :attr:`CheckEntry.model` in the API's default variant
  (:meth:`conformance.apis.HookApi.plans`), with a suite test function of that name in the API's suite module
  (:func:`conformance.suite.catalogued_tests`).

A new check on every API is then its rank function, its entry here, its docs and its zoo entry
(``docs/checks.md``; ``tests/test_catalogue.py`` adds a throw-away one and finds it planned, registered and run
on every API). This module is the foundation layer (docs/layers.md): it imports nothing of the suite.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

__all__ = ["AVERAGING", "CASE_KINDS", "CATALOGUE", "CHECK_TRAINING", "CLIP_GRAD_NORM", "CLIP_MAX_NORM", "CheckEntry",
           "HARD_INPUTS", "LONG_RUN", "LR", "MOMENTUM", "PARITY", "SECOND_MODEL", "catalogued", "declare"]

#: How the controller runs a case of a suite test (:mod:`conformance.controller.case_kinds`):
#: ``exact`` (an exactness check whose unexplained failure ends with how to declare a lossy contract),
#: ``plain``, ``across_ranks`` (each rank's gradients against rank 0's), ``hard_inputs`` (the named
#: examples, then hypothesis's, shrunk on failure), ``switches`` (a combined case: the API's long run where a
#: hook's switches hold at once; the nightly's own runs only where the hook's code has a never-taken branch,
#: :mod:`conformance.apis.switches`), and the three lossy-contract checks.
CASE_KINDS = ("exact", "plain", "across_ranks", "hard_inputs", "switches", "lossy_error", "lossy_loss",
              "lossy_determinism")

# -- how the shared checks train -------------------------------------------------------------------------------

#: SGD's momentum in every check that trains several steps in lock step (parity, clip, the lossy contracts): a
#: gradient difference then reaches the parameters through the optimizer's state too. The averaging check's
#: analytic model trains without momentum.
MOMENTUM = 0.9
#: SGD's learning rate in every shared check but the analytic averaging.
LR = 0.01

#: ``Linear(1, world_size)`` with input = rank, 4 steps of plain SGD (no momentum).
AVERAGING: Mapping[str, Any] = MappingProxyType(
    {"model": "analytic_linear", "steps": 4, "lr": 0.1, "momentum": 0.0, "optimizer_step": True})
#: The case's model, 3 steps (fewer where the model has a ``max_steps``).
PARITY: Mapping[str, Any] = MappingProxyType({"steps": 3, "lr": LR, "momentum": MOMENTUM, "optimizer_step": True})
#: The case's model and steps (``LONG_RUN_STEPS``), a regression onto random targets with inputs that change
#: every step.
LONG_RUN: Mapping[str, Any] = MappingProxyType(
    {"steps": 0, "lr": LR, "momentum": MOMENTUM, "optimizer_step": True, "objective": "regression"})
#: The gradient probe, one example a step, no optimizer step.
HARD_INPUTS: Mapping[str, Any] = MappingProxyType(
    {"model": "gradient_probe", "steps": 1, "lr": LR, "momentum": MOMENTUM, "optimizer_step": False})
#: ``clip_grad_norm_(CLIP_MAX_NORM, norm_type)`` after every backward, for norm types 2 and inf: a bound that
#: every gradient here exceeds, so every step clips.
CLIP_MAX_NORM = 1e-2
#: The case's model, 2 steps, each backward followed by the API's ``clip_grad_norm_`` (``clip_max_norm``).
CLIP_GRAD_NORM: Mapping[str, Any] = MappingProxyType(
    {"steps": 2, "lr": LR, "momentum": MOMENTUM, "optimizer_step": True, "clip_max_norm": CLIP_MAX_NORM})
#: The second-model check: the case's model trained hooked for ``steps``, then a second, different model
#: (``second``) built, hooked and held to parity in the same process for ``steps``.
SECOND_MODEL: Mapping[str, Any] = MappingProxyType(
    {"steps": 2, "lr": LR, "momentum": MOMENTUM, "optimizer_step": True, "second": "net_flat"})


@dataclasses.dataclass(frozen=True)
class CheckEntry:
    """One shared check, declared once.

    Attributes:
        name: the rank check's name; an API registers it as ``<api>.<name>``.
        kind: how the controller runs its cases, one of :data:`CASE_KINDS` (the kind of the suite tests the
            catalogue plans; an API that plans its own may run some as another, e.g. a subgroup parity as
            ``plain``).
        summary: one line of what it asserts: the docstring of the suite test functions the catalogue makes.
        training: how it trains, its rank function's keyword defaults and a reproducer's ``CASE``
            (``model``, ``steps``, ``lr``, ``momentum``, ``optimizer_step``, and its own); ``None``: no
            reproducer is written for its failures (the re-run command is).
        replay_reference: a failure is replayed with the reference alone (``reference_only=True``, which the
            rank function then takes): a reference PyTorch cannot run here skips the case.
        replay_default_hook: a failure no cause of the hook's explains is replayed with PyTorch's default hook
            in the hook's place: the check runs the same with any spec of its API, and its reference is
            PyTorch's behaviour on this torch version.
        catalogued: the catalogue plans its cases on every API of :attr:`apis` (below); ``False``: each API
            plans its own suite tests of it.
        apis: the APIs it runs on (``HookSpec.api`` values); ``None``: every API.
        claims: the specs it is for: ``"exact"`` (no lossy contract), ``"lossy"`` or ``"all"``.
        world_sizes: ``"main"`` (the run's main world size, ``--world-size``) or ``"every"`` (each of the
            run's world sizes of at least 2 ranks).
        model: the reference model of its cases (a :data:`conformance.models.MODELS` name).

    Raises:
        ValueError: an unknown kind, claim or world-size choice, or a catalogued entry with no model.
    """

    name: str
    kind: str
    summary: str
    training: Optional[Mapping[str, Any]] = None
    replay_reference: bool = False
    replay_default_hook: bool = False
    catalogued: bool = False
    apis: Optional[Tuple[str, ...]] = None
    claims: str = "exact"
    world_sizes: str = "main"
    model: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in CASE_KINDS:
            raise ValueError(f"check {self.name!r}: kind {self.kind!r} is not one of {', '.join(CASE_KINDS)}")
        if self.claims not in ("exact", "lossy", "all"):
            raise ValueError(f"check {self.name!r}: claims {self.claims!r} is not 'exact', 'lossy' or 'all'")
        if self.world_sizes not in ("main", "every"):
            raise ValueError(f"check {self.name!r}: world_sizes {self.world_sizes!r} is not 'main' or 'every'")
        if self.catalogued and not self.model:
            raise ValueError(f"check {self.name!r} is planned by the catalogue, so it names its model")

    def runs_on(self, api: str) -> bool:
        """Whether the catalogue plans this check's cases on ``api``."""
        return self.catalogued and (self.apis is None or api in self.apis)

    def for_spec(self, spec: HookSpec) -> bool:
        """Whether a spec's claim (``HookSpec.lossy``) is one this check is for (:attr:`claims`)."""
        lossy = getattr(spec, "lossy", None) is not None
        return self.claims == "all" or (self.claims == "lossy") == lossy


#: Every shared check, by name.
CATALOGUE: Dict[str, CheckEntry] = {}


def declare(entry: CheckEntry) -> CheckEntry:
    """Add ``entry`` to :data:`CATALOGUE` (and return it).

    Raises:
        ValueError: a check of that name is declared already.
    """
    if entry.name in CATALOGUE:
        raise ValueError(f"check {entry.name!r} is declared twice in the catalogue")
    CATALOGUE[entry.name] = entry
    return entry


def catalogued(api: str) -> Tuple[CheckEntry, ...]:
    """The entries the catalogue plans on ``api``, in declaration order."""
    return tuple(entry for entry in CATALOGUE.values() if entry.runs_on(api))


def check_training() -> Mapping[str, Mapping[str, Any]]:
    """The checks a reproducer replays, with how they train (:attr:`CheckEntry.training`)."""
    return MappingProxyType({name: e.training for name, e in CATALOGUE.items() if e.training is not None})


_EVERY_STEP = "gradients and parameters bitwise equal to the reference (the native path for the claim) every step"

declare(CheckEntry("averaging", "exact", "Linear(1, world_size) with input = rank: every gradient element is "
                   "mean(0..ws-1), exactly", training=AVERAGING, replay_default_hook=True))
declare(CheckEntry("parity", "exact", _EVERY_STEP.capitalize(), training=PARITY, replay_reference=True,
                   replay_default_hook=True))
declare(CheckEntry("long_run", "exact", "256 steps (2,000 at nightly depth): " + _EVERY_STEP, training=LONG_RUN,
                   replay_reference=True, replay_default_hook=True))
declare(CheckEntry("clip_grad_norm", "plain", "clip_grad_norm_ (norm types 2 and inf) with the hook: norm and "
                   "gradients as the reference's", training=CLIP_GRAD_NORM, replay_reference=True,
                   replay_default_hook=True))
declare(CheckEntry("hard_inputs", "hard_inputs", "Near-overflow, zero, subnormal, NaN and Inf gradients, bitwise "
                   "equal to the reference", training=HARD_INPUTS))
declare(CheckEntry("rank_grads", "across_ranks", "Every rank holds the identical gradient after each step",
                   replay_default_hook=True, claims="all"))
declare(CheckEntry("lossy_error", "lossy_error", "A lossy contract: each gradient's relative error against the "
                   "exact float64 mean within the bound", claims="lossy"))
declare(CheckEntry("lossy_loss", "lossy_loss", "A lossy contract: the training loss within the declared margin of "
                   "native's", claims="lossy"))
declare(CheckEntry("lossy_determinism", "lossy_determinism", "A lossy contract: two trainings from the same seed "
                   "give bitwise identical gradients", claims="lossy"))
declare(CheckEntry(
    "second_model", "exact", "A second, different model wrapped and hooked in the same process after a first one "
    "trained: " + _EVERY_STEP + " (state a hook keeps outside its state object must not outlive its model)",
    training=None, replay_reference=True, replay_default_hook=True, catalogued=True, model="nested_wrapped"))

#: The checks a reproducer replays, with how they train (read by :mod:`conformance.reproducers.writer`).
CHECK_TRAINING = check_training()
