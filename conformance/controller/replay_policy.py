"""Which failed cases the controller replays, and how: controller policy over the shared rank checks.

After a failure the runner may run the case again in two ways (:mod:`conformance.controller.replays`):

* with the **reference alone** (``reference_only=True``): the check builds and trains only its reference
  model (the native path, no hook), so the controller can tell a reference that PyTorch cannot run here
  (a skip) from a hook that broke it (a failure). Only a check that takes ``reference_only`` can;
* with **PyTorch's default hook** in the hook's place (:mod:`conformance.controller.default_replay`): where
  the check runs the same with any spec of its API and its reference is PyTorch's behaviour on this
  torch version, a failure that no cause of the hook's own explains may be PyTorch's.

The rank side only runs what it is asked; which of its shared checks are replayed each says in its entry of
the check catalogue (:attr:`conformance.catalogue.CheckEntry.replay_reference` and ``replay_default_hook``), read
here.
``tests/test_reference_replay.py`` holds every name of :data:`REFERENCE_REPLAYABLE` to a check that takes
``reference_only``.
"""

from __future__ import annotations

from typing import FrozenSet

from conformance.apis.registry import HOOK_APIS
from conformance.catalogue import CATALOGUE

__all__ = ["DEFAULT_HOOK_REPLAYABLE", "REFERENCE_REPLAYABLE", "REPLAYS_DEFAULT_HOOK", "REPLAYS_REFERENCE"]

#: The shared checks replayed with their reference alone: each takes ``reference_only=True``.
REFERENCE_REPLAYABLE: FrozenSet[str] = frozenset(name for name, e in CATALOGUE.items() if e.replay_reference)
#: The shared checks replayed with PyTorch's own default hook: each runs the same with any spec of its API,
#: and its reference is PyTorch's behaviour on this torch version.
DEFAULT_HOOK_REPLAYABLE: FrozenSet[str] = frozenset(name for name, e in CATALOGUE.items() if e.replay_default_hook)


def _registered(shared: FrozenSet[str]) -> FrozenSet[str]:
    """The registered names (``<api>.<check>``) of the shared checks in ``shared`` that any API's suite tests
    run (:data:`conformance.apis.registry.HOOK_APIS`)."""
    return frozenset(test.rank_check_name for api in HOOK_APIS.values() for test in api.plans.values()
                     if test.rank_check in shared)


#: Rank checks (``"fsdp.parity"``) the runner replays with ``reference_only=True``.
REPLAYS_REFERENCE = _registered(REFERENCE_REPLAYABLE)
#: Rank checks the runner may replay with PyTorch's own default hook.
REPLAYS_DEFAULT_HOOK = _registered(DEFAULT_HOOK_REPLAYABLE)
