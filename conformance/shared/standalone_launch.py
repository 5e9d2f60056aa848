"""A reproducer's launcher: ``python FILE.py`` starts the case's ranks on this machine and exits with their verdict.

Written into every reproducer (:mod:`conformance.reproducers`). ``torch.multiprocessing.start_processes`` starts
one process per rank running the file's ``run(rank)`` (forked for CPU ranks, spawned for GPU ones: :func:`launch`),
with the variables torchrun sets (on the case's backend, as the suite placed it: gloo on CPU, or NCCL with one GPU a
process); once a rank exits other than 0, the others are stopped. The exit status is 1 where a rank saw the
difference, 0 where none did, 2 where the case could not run (a rank's status that is no verdict is named). Reads the file's ``CASE`` when
called. Torch only.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Dict

import torch
import torch.multiprocessing


def layout_env(rank: int, world_size: int, nodes: int) -> Dict[str, str]:
    """torchrun's layout variables of ``rank`` on ``nodes`` nodes of ``world_size // nodes`` ranks (the suite's
    ``conformance.ranks.topology.torchrun_env``), for a case that simulated several nodes."""
    local = world_size // nodes
    return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size)}


#: NCCL's own choices that make a reduction's bits a function of its inputs alone, as torchtitan's batch-invariant
#: mode pins them: NCCL otherwise picks its algorithm, protocol and channel count by message size and topology,
#: and each sums in another order (ring and tree differ in about a third of the elements of an all-reduce). Set in
#: every NCCL rank before its first communicator (:func:`pin_nccl`), each unless the user's environment sets it.
NCCL_PINNED = {
    "NCCL_ALGO": "Ring",  # one algorithm at every size (Tree, PAT, NVLS and CollNet sum in other orders)
    "NCCL_PROTO": "Simple",  # LL and LL128 cut a message otherwise
    "NCCL_MIN_NCHANNELS": "1",  # one channel: how a message splits across channels is fixed
    "NCCL_MAX_NCHANNELS": "1",
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP reductions are not even run-to-run deterministic (NVIDIA/nccl#1497)
    "NCCL_COLLNET_ENABLE": "0",  # reductions in the network (SHARP switches)
}


def pin_nccl(env: Dict[str, str]) -> Dict[str, str]:
    """Set each of :data:`NCCL_PINNED` in ``env`` (``os.environ`` in a rank, before ``init_process_group``) that it
    does not set already: a variable the user set wins. Returns the variables set here."""
    pinned = {name: value for name, value in NCCL_PINNED.items() if name not in env}
    env.update(pinned)
    return pinned


#: The reproducer's exit statuses, whichever way it was started (``python FILE.py`` or as torchrun's worker).
NOT_REPRODUCED, REPRODUCED, COULD_NOT_RUN = 0, 1, 2


def launch() -> int:
    """``python FILE.py``: the case's ranks on this machine, ``run(rank)`` in a process each
    (``MASTER_ADDR`` / ``MASTER_PORT`` on loopback, as torchrun sets them; CPU ranks see no GPU), and their
    verdict: ``torch.multiprocessing.start_processes`` raises for the first rank that exited other than 0 (and
    stops the others); its status where it is a verdict (1 reproduced, 2 could not run), else 2, with a line
    naming the signal or the status. CPU ranks (gloo) are forked from a launcher of one thread, so they inherit
    torch's import (seconds of CPU a rank); GPU ranks are spawned, and so are CPU ones where another thread (a hook
    module's) would make a fork unsafe."""
    n = CASE["world_size"]
    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        os.environ.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(s.getsockname()[1]))
    if CASE["backend"] == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks, as the suite's
    tasks = "/proc/self/task"  # Linux: one entry per thread. CPU ranks fork (torch imported) from one thread only
    fork = CASE["backend"] == "gloo" and os.path.isdir(tasks) and len(os.listdir(tasks)) == 1
    try:
        torch.multiprocessing.start_processes(run, nprocs=n, start_method="fork" if fork else "spawn")
    except torch.multiprocessing.ProcessExitedException as exc:  # the first rank that exited other than 0
        code = exc.exit_code
        if code not in (REPRODUCED, COULD_NOT_RUN):  # no verdict: a signal (-N), or a status of its own
            how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            print(f"could not run: rank {exc.error_index} {how}", flush=True)
        return code if code in (REPRODUCED, COULD_NOT_RUN) else COULD_NOT_RUN
    return NOT_REPRODUCED
