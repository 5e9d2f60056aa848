"""How the shared rank checks train: the defaults their signatures take, and what a reproducer copies.

The rank checks (:mod:`conformance.ranks.checks.exact`, ``long_run``, ``probe``) take these as their
keyword defaults, and the reproducer writer (:mod:`conformance.reproducers.writer`) writes the same
values into a failed case's ``CASE``, so a standalone file trains as the suite did. Both sides read
them from here: the writer runs in the controller, which never imports the rank side (docs/layers.md).

Each entry of :data:`CHECK_TRAINING` (by rank check, the part of ``<api>.<check>`` after the API):
``model`` (a :data:`conformance.models.MODELS` name, where the check has a default one), ``steps``
(training steps; the long run's come from its case), ``lr`` (SGD's learning rate), ``momentum``
(SGD's momentum), ``optimizer_step`` (whether SGD steps after each backward) and, for the long run,
``objective`` (``"regression"``: :func:`conformance.shared.standalone_main.regression_inputs`), for the clip
check ``clip_max_norm`` (``clip_grad_norm_``'s bound after every backward).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["AVERAGING", "CHECK_TRAINING", "CLIP_GRAD_NORM", "CLIP_MAX_NORM", "HARD_INPUTS", "LONG_RUN", "LR",
           "MOMENTUM", "PARITY"]

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

#: The rank checks a reproducer replays, with how they train.
CHECK_TRAINING: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {"averaging": AVERAGING, "parity": PARITY, "long_run": LONG_RUN, "hard_inputs": HARD_INPUTS,
     "clip_grad_norm": CLIP_GRAD_NORM})
