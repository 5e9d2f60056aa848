"""The node layout a case runs under, as torchrun's environment gives it to a rank (standard library only).

A hook may read the layout of its job to build a two-level reduction (within a
node, then across nodes) or a divisor: ``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,
``GROUP_RANK`` (the node's rank) and their kin, which
``torch.distributed.elastic`` (torchrun) sets in every worker
(``torch/distributed/elastic/agent/server/api.py``, ``SimpleElasticAgent._assign_worker_ranks``
and ``LocalElasticAgent._start_workers``). Such a hook takes another path as soon as a job
spans two nodes. The local pools run on one machine, so each rank sets the variables
itself: those of one node of ``world_size`` ranks when it starts (as ``torchrun
--nproc-per-node N`` on one node would), and, for the duration of a case that
simulates several nodes, those of that layout (:func:`simulated`). Ranks that torchrun
started (``--listen``) keep the real ones.

:func:`torchrun_env` mirrors the agent's assignment for a homogeneous job:
``nodes`` nodes of ``world_size // nodes`` ranks each, node ``n`` holding the global
ranks ``n * local_world_size ... (n + 1) * local_world_size - 1``, one role.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Mapping, Optional

__all__ = ["TORCHRUN_LAYOUT_VARIABLES", "layout_text", "nodes_of_env", "simulated", "torchrun_env"]

#: The variables torchrun sets that describe the job's layout (``RANK`` and ``WORLD_SIZE`` included; not
#: ``MASTER_ADDR``/``MASTER_PORT``, which the local pools do not rendezvous through).
TORCHRUN_LAYOUT_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")


def torchrun_env(rank: int, world_size: int, nodes: int = 1) -> Dict[str, str]:
    """torchrun's layout variables for global ``rank`` of a job of ``world_size`` ranks on ``nodes`` nodes.

    Raises:
        ValueError: ``nodes`` is not a positive divisor of ``world_size``, or ``rank`` is out of range.
    """
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks cannot be laid out as {nodes} nodes of equal size: pick a number of "
                         "nodes that divides the world size")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    local = world_size // nodes
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default"}


def nodes_of_env(env: Mapping[str, str]) -> Optional[int]:
    """The number of nodes torchrun's variables in ``env`` describe (``GROUP_WORLD_SIZE``, else
    ``WORLD_SIZE // LOCAL_WORLD_SIZE``), or ``None`` where they say nothing."""
    try:
        if env.get("GROUP_WORLD_SIZE"):
            return int(env["GROUP_WORLD_SIZE"])
        if env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
            return max(1, int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]))
    except ValueError:
        return None
    return None


def layout_text(world_size: int, nodes: int) -> str:
    """``"2 nodes of 2 ranks"``, ``"1 node of 3 ranks"``: a layout in words, for reports."""
    local = world_size // max(nodes, 1)
    return f"{nodes} node{'s' if nodes != 1 else ''} of {local} rank{'s' if local != 1 else ''}"


@contextlib.contextmanager
def simulated(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block, then put back what was there (a variable that was unset
    is unset again)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
