"""Where two switches meet: the combined cases every API's plan adds, from its long run.

The suite's reach cases run each axis on its own: the long runs train small models, the production-sized probe
trains two steps, the node layouts run small models. A hook whose other path needs a warm-up *and* a large
buffer, or several nodes *and* a large buffer, passes all of them without ever taking it. A combined case is the
API's own long run (its config, its check, every step compared bit for bit) on a switch probe past the size
(``models/switch.py``), for steps past the count, in the node layout, all at once:

* a spec that names its switches (``HookSpec(switches=Switches(...))``) gets one at every depth, sized by them;
* at ``--depth nightly`` every exact spec that names none gets the nightly's own combination
  (:data:`COMBINED_STEPS` steps on :data:`COMBINED_MODEL`, 4.25 MiB of float32, on :data:`COMBINED_NODES` nodes),
  which runs only where the hook's own code still has a branch its other cases never took (the controller asks
  the hook-code ledger first: a hook with no never-taken branch costs nothing).

Each API names its suite test ``test_<api>_switches`` (check ``switches``, ``fsdp2_switches``, ...), planned by
:func:`switch_plan` over its long run's plan and run by the shared ``long_run`` rank check. Only the API contract,
the foundation and the models are imported: a plan module imports this one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch

from conformance.apis import CasePlan, SuiteTest
from conformance.cases import CaseParams
from conformance.models import SWITCH_PROBES, switch_probe_for

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings
    from conformance.spec import HookSpec

__all__ = ["COMBINED_MODEL", "COMBINED_NODES", "COMBINED_STEPS", "SWITCH_MARGIN_STEPS", "SWITCH_STEPS", "SwitchTarget",
           "combined_case", "named", "switch_plan", "switch_target"]

#: Steps of the nightly's own combined case: past the warm-ups real hooks take (torchft's and the zoo's: 10 to
#: 150 steps); PowerSGD's default ``start_powerSGD_iter`` of 1,000 needs its switch named.
COMBINED_STEPS = 300
#: The nightly's combined case's model: ``switch_probe_1m``, 2**20 + 2**16 + 3 elements (4.25 MiB of float32): a
#: buffer of production size (an FSDP unit of a million elements; past DDP's 1 MiB first bucket and the 1 to 4 MiB
#: at which real hooks chunk and compress), at a quarter of the largest probe's cost a step (300 steps of FSDP2 on
#: the 17 MiB one took three minutes here). A hook that switches on more names its switch: its own combined case
#: is sized for it, up to 17 MiB.
COMBINED_MODEL = "switch_probe_1m"
#: The nightly's combined case's node layout: two nodes (2 ranks as 2 nodes of 1 at the main world size of 2).
COMBINED_NODES = 2
#: Steps a named switch's case trains where the spec names no step switch: past DDP's bucket rebuild (step 1).
SWITCH_STEPS = 16
#: Steps it trains past a named step switch: at least this many, and a quarter of the switch.
SWITCH_MARGIN_STEPS = 16


@dataclasses.dataclass(frozen=True)
class SwitchTarget:
    """What a combined case must reach together: ``steps`` trained, ``elements`` of the buffer the hook is handed
    (``None``: any), ``nodes`` (1: one node), and whether it is the spec's own (``named``) or the nightly's, which
    trains ``model``."""

    steps: int
    elements: Optional[int]
    nodes: int
    named: bool
    model: Optional[str] = None


def switch_target(spec: HookSpec, nightly: bool) -> Optional[SwitchTarget]:
    """The combined case ``spec`` gets: its named switches (:class:`~conformance.spec.Switches`), else at nightly
    depth the nightly's own combination; ``None``: none (a lossy contract, or no switch at the default depth)."""
    if getattr(spec, "lossy", None) is not None:
        return None
    switches = getattr(spec, "switches", None)
    if switches is None:
        if not nightly:
            return None
        return SwitchTarget(COMBINED_STEPS, None, COMBINED_NODES, named=False, model=COMBINED_MODEL)
    dtype = spec.reduce_dtype or spec.param_dtype or torch.float32
    steps = switches.steps + max(SWITCH_MARGIN_STEPS, switches.steps // 4) if switches.steps else SWITCH_STEPS
    return SwitchTarget(steps, switches.elements_for(torch.empty((), dtype=dtype).element_size()),
                        switches.nodes or 1, named=True)


def _layout(world_size: int, nodes: int) -> int:
    """The world size of a case of ``nodes`` nodes grown from one of ``world_size`` ranks: the same where it
    divides, else the next multiple of ``nodes``."""
    return world_size if world_size % nodes == 0 and world_size >= nodes else nodes * -(-world_size // nodes)


def combined_case(case: CaseParams, target: SwitchTarget) -> CaseParams:
    """``case`` (the API's long run of the spec) as the combined case of ``target``: the switch probe that hands
    the hook a buffer past the size (the smallest whose parameter holds ``elements`` times the world size, so
    that a hook handed a shard of it still gets that many), trained ``steps`` steps, on the nodes asked."""
    nodes = max(case.nodes, target.nodes)
    world_size = _layout(case.world_size, nodes)
    model, reached = (target.model, True) if target.model else switch_probe_for((target.elements or 1) * world_size)
    skip = case.skip
    if skip is None and not reached:
        skip = (f"the hook's size switch, {target.elements:,} elements, is past the largest model the suite trains "
                f"for a long run ({SWITCH_PROBES[model].numel:,} elements a parameter, over {world_size} ranks): "
                "nothing here can hand the hook so large a buffer")
    return dataclasses.replace(case, model=model, steps=target.steps, nodes=nodes, world_size=world_size, skip=skip)


def switch_plan(long_run: CasePlan) -> CasePlan:
    """The plan of an API's ``switches`` suite test over its long run's plan ``long_run``: per spec with a
    :func:`switch_target`, the first of its long-run cases at the run's main world size (its config, sharding
    strategy or mesh), made :func:`combined_case`."""
    def plan(test: SuiteTest, specs: Sequence[Any], settings: Settings) -> List[CaseParams]:
        out: List[CaseParams] = []
        for spec in specs:
            target = switch_target(spec, settings.nightly)
            if target is None:
                continue
            cases = long_run(test, [spec], settings)
            ordered = sorted(cases, key=lambda c: (c.skip is not None, c.world_size != settings.world_size))
            if ordered:
                out.append(combined_case(ordered[0], target))
        return out

    return plan


def named(spec: HookSpec) -> bool:
    """Whether ``spec`` names its switches (its combined case runs whatever its hook code shows)."""
    return getattr(spec, "switches", None) is not None

