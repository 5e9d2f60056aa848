"""What one training step costs on the wire, measured on this rank for the hooked model and for native (rank side).

A hook is written to save time; its verdict says whether it is right, and this meter says what it costs: the
collectives a training step issues, by kind, and the bytes and elements they move on this rank, by dtype, for the
hooked model and for the reference (native) model of the same case, on the same inputs. The numbers come from
PyTorch's flight recorder (``torch._C._distributed_c10d._dump_fr_trace`` for gloo, ``_dump_nccl_trace`` for
NCCL), which records every collective a process group issues, whoever issues it: DDP's reducer in C++, FSDP's
all-gathers and reduce-scatters, a hook's own calls, and those a hook issues inside a future's ``.then()``
callback on gloo's completion thread, which PyTorch's ``CommDebugMode`` (a dispatch mode, thread-local) misses.
Nothing of ``torch.distributed`` is replaced, so a hook's ``dist.P2POp(dist.isend, ...)`` runs as it does
anywhere; gloo's recorder has no point-to-point entries, so those are not counted there (``docs/cost.md``).

How: each check wraps a training step of each model in :func:`measured` (``side`` ``"native"`` or
``"hooked"``), which notes the step's wall-clock window (``time.time_ns``, the clock the recorder stamps
``time_created_ns`` with) and, on CUDA, a pair of CUDA events. Only :data:`MEASURED_STEPS` are measured (steps 0
to 2; the last a case trained on both models is reported, and called warm past step 0); the recorder is read
once, when both sides of the last are in (or at the case's end), and each window's entries are the ones created
inside it. One read per case keeps the meter's cost to a few milliseconds a case (5 ms median, 1-2 % of the
default run on a 2-core machine: ``benchmarks/cost_meter.py``) at the
suite's ring size (:data:`RING_ENTRIES`). The worker starts a fresh meter per case (:func:`start`) and sends
:func:`read` with the case's outcome.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import threading
import time
from typing import Any, Dict, Iterator, List, MutableMapping, Optional, Sequence, Tuple, Union

import torch

__all__ = ["MEASURED_STEPS", "RING_ENTRIES", "kind_of", "measured", "read", "ring_defaults", "start", "suite_own",
           "summarise"]

#: The training steps measured; the reports use the last of them a case trained on both models. Step 2 is the
#: first warm one: DDP rebuilds its buckets at step 1 (two int32 broadcasts), FSDP's first step gathers cold, and
#: the suite starts PowerSGD's compression at iteration 2 (``POWERSGD_START_ITER``).
MEASURED_STEPS = (0, 1, 2)
#: The flight recorder's ring, in entries, that a rank sets unless the user's environment sets one: enough for two
#: training steps of the suite's models and the comparisons between them, small enough that reading it costs
#: a few milliseconds. A window older than the ring's oldest entry is reported as lost, never as zero.
RING_ENTRIES = 256
#: The environment variables that size the ring: torch 2.7+ reads the first, older NCCL the second.
RING_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

#: What a collective is, from the recorder's ``profiling_name`` (``gloo:all_reduce``, ``nccl:_reduce_scatter_base``,
#: ``nccl:all_gather_into_tensor_coalesced``, ``nccl:send 0->1``): the first of these words it holds.
_KINDS = (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"), ("allgather", "all_gather"),
          ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("all_to_all", "all_to_all"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"), ("send", "point_to_point"),
          ("recv", "point_to_point"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"))

#: The recorder's dtype names (c10's ScalarType names) as torch spells them.
_DTYPES = {"Half": "float16", "Float": "float32", "Double": "float64", "BFloat16": "bfloat16", "Int": "int32",
           "Long": "int64", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
           "ComplexFloat": "complex64", "ComplexDouble": "complex128", "ComplexHalf": "complex32"}

_WINDOWS: List[Dict[str, Any]] = []
#: ``(thread, begin, end)`` of the suite's own collectives inside a measured step (:func:`suite_own`).
_SUITE_OWN: List[Tuple[str, int, int]] = []
_STATE: Dict[str, Any] = {"entries": None, "lost": "", "oldest_ns": None, "meter_s": 0.0}


def ring_defaults(env: MutableMapping[str, str], version: str = torch.__version__) -> Dict[str, str]:
    """Size the flight recorder's ring in ``env`` (``os.environ`` in a rank, before its first process group)
    unless the user sized it: :data:`RING_ENTRIES` under ``TORCH_FR_BUFFER_SIZE``, and under
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` too for a torch ``version`` before 2.8, which reads only that one (2.8 and
    later warn that it is deprecated). Returns what it set."""
    if any(name in env for name in RING_VARIABLES):
        return {}
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    names = RING_VARIABLES if major_minor < (2, 8) else RING_VARIABLES[:1]
    chosen = {name: str(RING_ENTRIES) for name in names}
    env.update(chosen)
    return chosen


def kind_of(profiling_name: str) -> str:
    """A collective's kind from the recorder's ``profiling_name``: ``all_reduce``, ``reduce_scatter``,
    ``all_gather``, ``all_to_all``, ``broadcast``, ``point_to_point``, ... or the name after the backend."""
    name = profiling_name.split(":", 1)[-1].strip().lower()
    for word, kind in _KINDS:
        if word in name:
            return kind
    return name.split(" ", 1)[0] or "unknown"


def _dtype(name: str) -> Tuple[str, int]:
    """``(torch's name, bytes per element)`` of a recorder dtype name (``"Half"`` -> ``("float16", 2)``)."""
    torch_name = _DTYPES.get(name, name.lower())
    dtype = getattr(torch, torch_name, None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return torch_name, size


def start() -> None:
    """A new case: no window, nothing read."""
    _WINDOWS.clear()
    _SUITE_OWN.clear()
    _STATE.update(entries=None, lost="", oldest_ns=None, meter_s=0.0)


def _recorder_reads() -> List[Any]:
    """The dump functions of the flight recorders this torch has: gloo's (and every CPU backend's), NCCL's."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    return [fn for fn in (getattr(c10d, "_dump_fr_trace", None), getattr(c10d, "_dump_nccl_trace", None)) if fn]


def _read_recorders() -> None:
    """Read every flight recorder once (no stack traces); the entries kept, or why none could be. Its time is the
    meter's own cost (``meter_ms`` of :func:`read`)."""
    started = time.perf_counter()
    try:
        _read_all()
    finally:
        _STATE["meter_s"] += time.perf_counter() - started


def _read_all() -> None:
    reads = _recorder_reads()
    if not reads:
        _STATE["lost"] = f"torch {torch.__version__} has no flight recorder for this backend"
        _STATE["entries"] = []
        return
    entries: List[Dict[str, Any]] = []
    oldest: Optional[int] = None
    for dump in reads:
        try:
            data = pickle.loads(dump(True, False, False))
        except Exception:  # noqa: BLE001 - a recorder this build cannot dump (NCCL's without CUDA) holds nothing here
            continue
        got = list(data.get("entries") or ())
        if got and int(got[0].get("record_id", 0)) > 0:  # the ring wrapped: older windows may be gone
            first = min(int(e.get("time_created_ns", 0)) for e in got)
            oldest = first if oldest is None else max(oldest, first)
        entries += got
    _STATE.update(entries=entries, oldest_ns=oldest)


def _ring_size() -> str:
    for name in RING_VARIABLES:
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    return "the default ring"


def _tensors(shapes: Optional[Sequence[Sequence[int]]], dtypes: Optional[Sequence[str]]) -> List[Tuple[int, str, int]]:
    """``(elements, dtype, bytes)`` of each tensor of a recorder entry's sizes and dtypes."""
    out = []
    for shape, dtype_name in zip(shapes or (), dtypes or ()):
        numel = math.prod(int(d) for d in shape)
        dtype, size = _dtype(str(dtype_name))
        out.append((numel, dtype, numel * size))
    return out


def summarise(entries: List[Dict[str, Any]], full_precision: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """One window's figures from its recorder entries: ``collectives`` (entries), ``by_kind`` (kind -> count), and
    the ``elements`` and ``bytes`` each collective moves on this rank, with ``bytes_by_dtype``.

    A collective moves the larger of what this rank hands it and what it gets back: the whole tensor a reduction
    covers (an all-reduce's, a reduce-scatter's input), the whole result a gather assembles (an all-gather's
    output: every rank's shard). So a hook that all-gathers every rank's full gradient to reduce it locally moves
    the group's size times what a reduce-scatter of that gradient moves, as it does on the wire, while the same
    figure needs no group size and no model of the backend's algorithm.

    ``full_precision``: dtypes (torch's names) that a reduced-precision claim's reference sends where native with no
    reduce dtype sends float32 (the suite's models' dtype): counted as float32 in ``bytes``, with what was measured
    kept under ``rescaled_from`` (dtype -> bytes). The same collectives and elements, so that a hook's bytes are
    held against native as a user runs it with no hook and no reduce dtype."""
    by_kind: Dict[str, int] = {}
    by_dtype: Dict[str, int] = {}
    rescaled: Dict[str, int] = {}
    elements = 0
    for e in entries:
        kind = kind_of(str(e.get("profiling_name", "")))
        by_kind[kind] = by_kind.get(kind, 0) + 1
        given = _tensors(e.get("input_sizes"), e.get("input_dtypes"))
        got = _tensors(e.get("output_sizes"), e.get("output_dtypes"))
        moved = got if sum(t[2] for t in got) > sum(t[2] for t in given) else given
        for numel, dtype, size in moved:
            elements += numel
            if dtype in full_precision:
                rescaled[dtype] = rescaled.get(dtype, 0) + size
                dtype, size = "float32", numel * 4
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    out: Dict[str, Any] = {"collectives": len(entries), "by_kind": by_kind, "elements": elements,
                           "bytes": sum(by_dtype.values()), "bytes_by_dtype": by_dtype}
    if rescaled:
        out["rescaled_from"] = rescaled
    return out


@contextlib.contextmanager
def suite_own() -> Iterator[None]:
    """Collectives the suite itself issues inside a measured step (a recorder's check of a call, as the all-gather
    recorder's ``all_gather_into_tensor`` of every rank's shard) are left out of the step's figures: the recorder
    entries this thread creates inside. A hook's cost never includes the suite's instrumentation."""
    begin = time.time_ns()
    try:
        yield
    finally:
        _SUITE_OWN.append((str(threading.get_ident()), begin, time.time_ns()))


def _hooks_or_apis(entry: Dict[str, Any]) -> bool:
    """Whether ``entry`` is not one of the suite's own collectives (:func:`suite_own`)."""
    created, thread = int(entry.get("time_created_ns", 0)), str(entry.get("thread_id", ""))
    return not any(thread == t and begin <= created <= end for t, begin, end in _SUITE_OWN)


@contextlib.contextmanager
def measured(side: str, step: int, device: Optional[torch.device] = None,
             full_precision: Sequence[Union[torch.dtype, str, None]] = ()) -> Iterator[None]:
    """Measure the training step ``step`` of one model (``side``: ``"native"`` or ``"hooked"``) run inside; a step
    outside :data:`MEASURED_STEPS` runs unmeasured. ``device``: the model's device; on CUDA the step is timed with
    CUDA events too (elapsed milliseconds, read at the case's end). ``full_precision``: of a reference that is a
    reduced-precision claim's native, the ``torch.dtype`` values (or names) it sends in place of float32
    (:func:`summarise`); ``None`` entries are ignored."""
    if step not in MEASURED_STEPS:
        yield
        return
    events = None
    if device is not None and getattr(device, "type", "") == "cuda":
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    begin = time.time_ns()
    try:
        yield
    finally:
        if events is not None:
            events[1].record()
        names = tuple(str(d).replace("torch.", "") for d in full_precision if d is not None)
        _WINDOWS.append({"side": side, "step": step, "begin": begin, "end": time.time_ns(), "events": events,
                         "full_precision": tuple(n for n in names if n != "float32")})
        last = MEASURED_STEPS[-1]
        if step == last and {w["side"] for w in _WINDOWS if w["step"] == last} >= {"native", "hooked"}:
            _read_recorders()


def read() -> Dict[str, Any]:
    """The case's cost on this rank: ``{"step": the step the figures are of, "warm": step > 0, "native": figures,
    "hooked": figures, "meter_ms": the meter's own time}`` (figures: :func:`summarise`, plus ``ms`` on CUDA), or
    ``{"not_measured": why}``; ``{}`` where no step of both models was measured (a check that trains one model, or
    none). ``meter_ms`` (reading the recorder and counting) is what ``benchmarks/cost_meter.py`` adds up."""
    sides_by_step: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for w in _WINDOWS:
        sides_by_step.setdefault(w["step"], {})[w["side"]] = w
    steps = [s for s, sides in sides_by_step.items() if {"native", "hooked"} <= set(sides)]
    if not steps:
        return {}
    if _STATE["entries"] is None:
        _read_recorders()
    if _STATE["lost"]:
        return {"not_measured": _STATE["lost"]}
    if not _STATE["entries"]:  # a case that trained two models across ranks issued collectives: the ring is off
        return {"not_measured": f"the flight recorder recorded nothing ({_ring_size()}; 0 turns it off)"}
    started = time.perf_counter()
    step = max(steps)
    out: Dict[str, Any] = {"step": step, "warm": step > 0}
    for side, w in sides_by_step[step].items():
        if _STATE["oldest_ns"] is not None and w["begin"] < _STATE["oldest_ns"]:
            return {"not_measured": f"more collectives than the flight recorder's ring holds ({_ring_size()}) "
                                    "between the measured step and the end of the case"}
        inside = [e for e in _STATE["entries"] if w["begin"] <= int(e.get("time_created_ns", 0)) <= w["end"]
                  and _hooks_or_apis(e)]
        figures = summarise(inside, w["full_precision"])
        if w["events"] is not None:
            torch.cuda.synchronize()
            figures["ms"] = float(w["events"][0].elapsed_time(w["events"][1]))
        out[side] = figures
    out["meter_ms"] = round((_STATE["meter_s"] + time.perf_counter() - started) * 1e3, 3)
    return out
