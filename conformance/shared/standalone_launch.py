"""A reproducer's launcher: ``python FILE.py`` starts the case's ranks on this machine and exits with their verdict.

Written into every reproducer (:mod:`conformance.reproducers`). One process per rank runs the file
as a worker, with the variables torchrun sets (gloo on CPU, or one process per GPU with NCCL:
:func:`select_backend`); the exit status is 1 where any rank saw the difference, 0 where none did, 2
where the case could not run (:func:`combine`). Reads the file's ``CASE`` when called. Torch only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

def layout_env(rank: int, world_size: int, nodes: int) -> Dict[str, str]:
    """torchrun's layout variables of ``rank`` on ``nodes`` nodes of ``world_size // nodes`` ranks (the suite's
    ``conformance.ranks.topology.torchrun_env``), for a case that simulated several nodes."""
    local = world_size // nodes
    return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size)}


#: The reproducer's exit statuses, whichever way it was started (``python FILE.py`` or as torchrun's worker).
NOT_REPRODUCED, REPRODUCED, COULD_NOT_RUN = 0, 1, 2
#: Seconds the launcher lets the other ranks finish after one rank ended with a verdict other than "no
#: difference" (a rank whose hook raised leaves the others waiting in a collective), before it stops them.
GRACE_S = 20.0


def select_backend(cuda_available: bool, gpu_count: int, local_world_size: int) -> Tuple[str, str]:
    """``(backend, device type)`` of the ranks on this machine: ``("nccl", "cuda")``, one GPU per process
    (``LOCAL_RANK``), where CUDA is available with a GPU for each of this machine's ``local_world_size`` ranks;
    else ``("gloo", "cpu")``. The suite places its pools the same way (``Settings.placement``: a world size
    larger than the GPUs runs on CPU ranks, gloo)."""
    return ("nccl", "cuda") if cuda_available and gpu_count >= local_world_size else ("gloo", "cpu")


def _stop(procs: List[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (it waits in a collective another rank left), and reap each."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def combine(codes: List[Optional[int]]) -> Tuple[int, List[str]]:
    """The launcher's exit status from its ranks' (``None``: stopped by the launcher after another rank's
    verdict), and the lines to print for ranks that died without one (a signal, an unexpected status):
    1 where any rank saw the difference, 0 where every rank saw none, else 2."""
    if REPRODUCED in codes or all(c == NOT_REPRODUCED for c in codes):
        return (REPRODUCED if REPRODUCED in codes else NOT_REPRODUCED), []
    return COULD_NOT_RUN, [f"could not run: rank {rank} was killed by signal {signal.Signals(-code).name}"
                           if code < 0 else f"could not run: rank {rank} exited with status {code}"
                           for rank, code in enumerate(codes)
                           if code not in (None, NOT_REPRODUCED, REPRODUCED, COULD_NOT_RUN)]


def launch(argv: List[str]) -> int:
    """``python FILE.py``: start the case's ranks on this machine, one process each running this file as a
    worker (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` on loopback, as torchrun sets them), and
    return their verdict (:func:`combine`). CPU ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``), as the suite's.
    Once a rank ends with a verdict other than "no difference", the others get :data:`GRACE_S` to end."""
    n = CASE["world_size"]
    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        env = dict(os.environ, WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(s.getsockname()[1]))
    if select_backend(torch.cuda.is_available(), torch.cuda.device_count(), n)[1] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *argv],
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in range(n)]
    deadline = float("inf")
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() <= deadline:
            if deadline == float("inf") and any(p.poll() not in (None, NOT_REPRODUCED) for p in procs):
                deadline = time.monotonic() + GRACE_S
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        print("could not run: interrupted", flush=True)
        return COULD_NOT_RUN
    codes = [p.poll() for p in procs]
    _stop(procs)
    code, lines = combine(codes)
    for line in lines:
        print(line, flush=True)
    return code
