"""What this machine can hold: CPU ranks by cores and memory, checked before any rank is spawned.

:func:`conformance.controller.settings.resolve` calls :func:`check_cpu_capacity` with the CPU
pools a run would start together; the bounds are a measured figure
(:data:`CPU_RANK_MEMORY_BYTES`) and a scheduling limit (:data:`MAX_CPU_RANKS_PER_CORE`).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

from conformance.controller.options import SettingsError

__all__ = ["CPU_RANK_MEMORY_BYTES", "MAX_CPU_RANKS_PER_CORE", "available_memory", "check_cpu_capacity", "cpu_count"]

#: Resident memory of one CPU rank, in bytes: a Python process with torch, FSDP and
#: ``torch._dynamo`` imported and the reference models trained. Measured during the
#: default run with torch 2.13 (CPU build) on this project's machine: 267 to 333 MB
#: per rank (RSS), so the peak is used. Sets the bound on CPU world sizes.
CPU_RANK_MEMORY_BYTES = 333 * 2**20
#: CPU ranks per core beyond which a run is refused: every collective needs every rank
#: scheduled, so far more ranks than cores turn each case into minutes of time slicing.
MAX_CPU_RANKS_PER_CORE = 16


def cpu_count() -> int:
    """Cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def available_memory() -> Optional[int]:
    """Bytes of memory available to new processes (``MemAvailable`` of /proc/meminfo), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_cpu_capacity(sizes: Sequence[Tuple[int, str]], cores: int, memory: Optional[int]) -> None:
    """Refuse CPU world sizes this machine cannot hold, before any rank is spawned.

    ``sizes`` are ``(world_size, source)`` pairs of the CPU pools, which start
    together, so their ranks add up. (FSDP2's 4-rank HSDP pool, started only
    for FSDP2 hooks, is left out: the per-core bound leaves room for it.)

    Raises:
        SettingsError: more ranks than ``MAX_CPU_RANKS_PER_CORE`` per core, or
            more than the available memory holds at ``CPU_RANK_MEMORY_BYTES`` each;
            the message names the option and the largest world size that fits.
    """
    total = sum(ws for ws, _ in sizes)
    if not total:
        return
    by_cores = MAX_CPU_RANKS_PER_CORE * cores
    by_memory = None if memory is None else memory // CPU_RANK_MEMORY_BYTES
    limit = by_cores if by_memory is None else min(by_cores, by_memory)
    if total <= limit:
        return
    ws, source = max(sizes)
    others = total - ws
    fits = max(limit - others, 0)
    why = []
    if by_memory is not None and total > by_memory:
        why.append(f"each CPU rank takes about {CPU_RANK_MEMORY_BYTES // 2**20} MB, so {total} ranks need about "
                   f"{_gib(total * CPU_RANK_MEMORY_BYTES)}, but {_gib(memory)} is available")
    if total > by_cores:
        why.append(f"this machine has {cores} core(s), and more than {MAX_CPU_RANKS_PER_CORE} ranks per core "
                   "leave every collective waiting on time slices")
    pools = " + ".join(str(w) for w, _ in sizes)
    raise SettingsError(
        f"world size {ws} from {source} is more CPU ranks than this machine can hold ({pools} ranks in pools that "
        f"start together): {'; and '.join(why)}. Nothing was started. Use a world size of at most {fits} here, "
        "or --extra-world-size 0 to drop the second pool.")
