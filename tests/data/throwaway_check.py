"""A throw-away exact check, added the way a new check is: its entry in the catalogue and its rank function.

``tests/test_catalogue.py`` imports this module in every interpreter of a suite run (the controller, the zygote
and the ranks, through a ``sitecustomize`` on ``PYTHONPATH``) and finds the check planned, collected and run on
every hook API, with no other file of the suite changed. The rank function is parity's over one step; it
leaves a file per API and rank in ``$THROWAWAY_MARKS``, so the test sees which APIs' models it ran with.
"""

from __future__ import annotations

import os

from conformance.catalogue import CheckEntry, declare

#: The check's name (its suite tests are ``test_<api>_throwaway_parity``, FSDP1's ``test_throwaway_parity``).
NAME = "throwaway_parity"

declare(CheckEntry(NAME, "exact", "A throw-away exact check: parity over one step", catalogued=True,
                   model="net_flat"))

from conformance.ranks.checks.common import shared_check  # noqa: E402  (after the entry it registers for)
from conformance.ranks.checks.exact import parity  # noqa: E402


@shared_check(NAME)
def throwaway_parity(ctx, spec, make, *, model, **variant):
    """Parity over one step; marks ``$THROWAWAY_MARKS/<models class>-<rank>``."""
    marks = os.environ.get("THROWAWAY_MARKS")
    if marks:
        with open(os.path.join(marks, f"{make.__name__}-{ctx.rank}"), "w") as f:
            f.write(spec.name)
    return parity(ctx, spec, make, model=model, steps=1, **variant)
