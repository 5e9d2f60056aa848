"""How far a case reached, as its ranks measured it: JUnit properties the per-hook verdict reads.

Each rank measures, per case, the training steps the hooked model lived through and the largest buffer the
hook was handed (:mod:`conformance.ranks.reach`); the node layout is the case's own
(:attr:`conformance.cases.CaseParams.nodes`, a JUnit property of every case). :func:`note_reach` turns the
ranks' figures into the case's ``steps`` and ``buffer_bytes`` properties, which the bookkeeper keeps per case
and, over the cases a hook passed, per hook (:mod:`conformance.reports.bookkeeper`): what its verdict says
it reaches.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from conformance.protocol import CaseResult
from conformance.reports.cost import COST_PROPERTY, combine_ranks
from conformance.reports.reach import REACH_PROPERTIES

__all__ = ["note_reach"]


def note_reach(request: Any, result: CaseResult, real_nodes: Optional[int] = None) -> None:
    """Give the test the reach its ranks measured as JUnit properties: for each of :data:`REACH_PROPERTIES`,
    the largest over the ranks and over the case's dispatches so far (a hard-input case sends several), where
    the hook was called at all. ``real_nodes``: the nodes torchrun spread the ranks over (``--listen``,
    :attr:`conformance.controller.remote.RemotePool.nodes`), which replace the case's own ``nodes``. The cost of a
    training step its ranks measured (:mod:`conformance.ranks.cost`) becomes its ``cost`` property, once."""
    props = request.node.user_properties
    held = dict(props)
    if real_nodes is not None and real_nodes != held.get("nodes"):
        props.append(("nodes", real_nodes))
    for key in REACH_PROPERTIES:
        value = max([int(o.reach.get(key, 0)) for o in result.outcomes if o.reach] + [int(held.get(key) or 0)])
        if value and value != held.get(key):
            props.append((key, value))
    cost = combine_ranks(o.cost for o in result.outcomes if o.ok)
    if cost and COST_PROPERTY not in held:  # a case of several dispatches (hard inputs) keeps its first step's
        props.append((COST_PROPERTY, json.dumps(cost, sort_keys=True, separators=(",", ":"))))
