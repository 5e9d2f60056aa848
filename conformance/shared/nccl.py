"""What NCCL a run's ranks use, for the results file and the Markdown summary: its version and every ``NCCL_*``
variable in force, the suite's pinned ones (:data:`~conformance.shared.standalone_launch.NCCL_PINNED`) included.

Each NCCL rank pins those variables itself before its first communicator
(:func:`~conformance.shared.standalone_launch.pin_nccl`, from :func:`conformance.ranks.worker.join_process_group`);
this module computes the same from the controller's environment, which a local pool's ranks inherit. Ranks that
torchrun starts on other nodes (``--listen``) get their node's environment, pinned the same way.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from conformance.shared.standalone_launch import NCCL_PINNED, pin_nccl

__all__ = ["nccl_record", "nccl_version"]


def nccl_version() -> Optional[str]:
    """The NCCL version this torch was built with (``torch.cuda.nccl.version()``, e.g. ``"2.21.5"``), or ``None``
    where it has none (a CPU build)."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL raises (AttributeError, RuntimeError) on any torch
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nccl_record(backend: str, env: Optional[Mapping[str, str]] = None,
                version: Callable[[], Optional[str]] = nccl_version) -> Optional[Dict[str, Any]]:
    """The JSON ``environment.nccl`` of a run on ``backend`` (``None`` unless ``"nccl"``), as its ranks get it from
    ``env`` (default ``os.environ``): ``{"version": "2.21.5" or None, "variables": {name: value} of every
    ``NCCL_*`` in force, sorted, "pinned_by_suite": [names the suite set], "set_by_user": [names of
    :data:`NCCL_PINNED` the environment already set, kept]}``."""
    if backend != "nccl":
        return None
    ranks_env = dict(os.environ if env is None else env)
    pinned = pin_nccl(ranks_env)
    return {"version": version(),
            "variables": {name: ranks_env[name] for name in sorted(ranks_env) if name.startswith("NCCL_")},
            "pinned_by_suite": sorted(pinned), "set_by_user": sorted(n for n in NCCL_PINNED if n not in pinned)}
