"""DDP's future contract, as the suite records it: what a ``DistributedDataParallel`` comm hook must return.

``DistributedDataParallel.register_comm_hook(state, hook)``: DDP calls
``hook(state, bucket)`` once per gradient bucket of a synchronising backward,
and the hook returns a ``torch.futures.Future`` whose value is one tensor with
the shape, dtype and device of ``bucket.buffer()``. DDP copies whatever it gets
into the gradients, converting dtypes silently, and fails deep inside its
reducer on a wrong shape or a value that is not a tensor. :class:`DDPHookRecorder`
stands between DDP and the hook under test and writes a finding first; its
:meth:`~DDPHookRecorder.step_failed` turns DDP's later failure into that finding,
and :meth:`~DDPHookRecorder.findings` says when DDP never called the hook. The
rank check ``ddp.future_contract`` (:mod:`conformance.apis.ddp.future`, the
API's own) trains with the recorder and also registers the bare hook, as DDP's
own checks see it; every other check of the API gets it from
:class:`~conformance.apis.ddp.models.DdpModels`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from conformance.apis.ddp.cpp_hooks import CPP_HOOK_NOTE, CppCommHook
from conformance.protocol import Finding, FindingKind
from conformance.ranks import hook_code, reach
from conformance.ranks.checks.models import Recorder
from conformance.ulps import dtype_name
from conformance.ranks.hook_call import CallLog, HookCall, counting_collectives

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import GradBucket


def _describe_value(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {dtype_name(value.dtype)}, on {value.device}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe_value(v) for v in list(value)[:2])
        more = ", ..." if len(value) > 2 else ""
        return f"a {type(value).__name__} of {len(value)} ({inner}{more})"
    if value is None:
        return "None"
    return f"a {type(value).__name__} ({value!r:.60})"


def _what_ddp_does_with(value: object) -> str:
    """What DDP's reducer does with a hook result that is not a Future (read off torch 2.13's reducer:
    pybind11 fails to cast it to ``c10::ivalue::Future``, except ``None``, which it dereferences)."""
    if value is None:
        return "crashes the process on None (SIGSEGV with torch 2.13)"
    return (f"raises a RuntimeError on {type(value).__module__}.{type(value).__qualname__} "
            "(\"DDP communication hook's callback must return a torch.futures.Future object\")")


def _short_error(exc: BaseException) -> str:
    """The innermost message of an exception that crossed DDP's C++ reducer and future callbacks."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    marker = "Got the following error when running the callback: "
    while marker in first:
        first = first.split(marker, 1)[1]
    if "tensor(" in first:  # DDP quotes the whole value it could not use
        first = first[:first.index("tensor(")] + "tensor(...)"
    return first[:300]


#: The most contract violations a check reports per rank (each call of a wrong hook adds one).
MAX_VIOLATIONS = 20


class DDPHookRecorder(Recorder):
    """Calls the hook under test for DDP and checks the future it returns.

    The contract (``DistributedDataParallel.register_comm_hook``): the hook
    returns a ``torch.futures.Future`` whose value is one tensor with the shape,
    dtype and device of ``bucket.buffer()`` as DDP handed it to the hook. DDP
    itself copies whatever it gets into the gradients, converting dtypes
    silently, and fails deep inside its reducer on a wrong shape or a value
    that is not a tensor; the recorder writes a :class:`Finding` first, so a
    check can report that instead of the reducer's error.

    Attributes:
        step: the training step, set by :meth:`begin_step` before each backward.
        calls: ``(step, bucket index)`` per hook call.
        violations: the first :data:`MAX_VIOLATIONS` contract violations by step, then bucket index: the
            futures' callbacks run as their collectives finish, in an order that changes from run to run,
            and a report must read the same each time.
        fatal: the hook returned something that is not a Future. DDP's reducer
            raises a ``RuntimeError`` on a Tensor or any other object ("DDP
            communication hook's callback must return a torch.futures.Future
            object, but got torch.Tensor") and crashes the process on ``None``
            (SIGSEGV with torch 2.13), so the recorder hands DDP a completed
            Future holding the untouched bucket instead, and the check stops
            with the finding.
    """

    def __init__(self, hook: Callable[..., object], rank: int, names: Dict[int, str]):
        self.hook = hook
        self.rank = rank
        self.names = names
        self.step = 0
        self.calls: List[Tuple[int, int]] = []
        self._violations: List[Tuple[int, int, int, Finding]] = []  # (step, bucket index, seen, finding)
        self.fatal = False
        self.log = CallLog()
        # DDP's register_comm_hook reads hook.__qualname__ (for its logger) and hook.__name__ (it refuses
        # the bf16 hooks by name where NCCL is missing): answer as the hook would, so DDP treats the
        # recorder as it treats the hook. Whether DDP accepts the bare hook is checked on its own.
        self.__qualname__ = getattr(hook, "__qualname__", type(hook).__qualname__)
        self.__name__ = getattr(hook, "__name__", type(hook).__name__)

    def findings_so_far(self, step: int) -> List[Finding]:
        """The contract violations recorded in ``step``: reported even where DDP went on without an error
        (a future longer than the bucket, whose leading elements DDP reads)."""
        return [f for f in self.violations if f.step == step]

    def never_called(self, step: int) -> List[Finding]:
        """A finding if DDP never called the hook in the synchronising ``step``."""
        if any(s == step for s, _ in self.calls):
            return []
        return [Finding(self.rank, "DDP never called the hook in this synchronising step", step=step,
                        kind=FindingKind.CONTRACT)]

    def findings(self, step: int) -> List[Finding]:
        """:meth:`never_called`, then the step's violations."""
        return self.never_called(step) + self.findings_so_far(step)

    def step_failed(self, step: int, exc: Exception) -> Optional[List[Finding]]:
        """A DDP failure after a recorded contract violation (a list, a wrong shape) is that violation plus one
        line with DDP's own error; a failure with no violation recorded (the hook itself raised) propagates
        unchanged (``None``)."""
        if not self.violations:
            return None
        return list(self.violations) + [Finding(
            self.rank, f"DDP then failed while using the hook's result: {_short_error(exc)}", step=step,
            kind=FindingKind.CONTRACT)]

    def end_step(self, step: int) -> Optional[List[Finding]]:
        """The contract findings where the hook broke DDP's contract so that the step means nothing."""
        return list(self.violations) if self.fatal else None

    def _bucket_text(self, bucket: GradBucket, index: int) -> str:
        try:
            params = [self.names.get(id(p), "?") for p in bucket.parameters()]
        except Exception:  # noqa: BLE001 - older GradBucket without parameters()
            params = []
        shown = ", ".join(params[:3]) + (f", ... ({len(params)} parameters)" if len(params) > 3 else "")
        return f"bucket {index}" + (f" [{shown}]" if shown else "")

    @property
    def violations(self) -> List[Finding]:
        # cut after sorting: which 20 are kept must not depend on the order the futures finished in either
        return [f for *_, f in sorted(self._violations, key=lambda v: v[:3])][:MAX_VIOLATIONS]

    def _note(self, message: str, step: int, index: int) -> None:
        self._violations.append((step, index, len(self._violations),
                                 Finding(self.rank, message, step=step, kind=FindingKind.CONTRACT)))

    # No annotations: DDP's _check_comm_hook compares them with dist.GradBucket, and under
    # ``from __future__ import annotations`` they would be strings.
    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        index, step = bucket.index(), self.step
        shape, dtype, device = tuple(buffer.shape), buffer.dtype, buffer.device
        where = self._bucket_text(bucket, index)
        self.calls.append((self.step, index))
        reach.saw_buffer(buffer)
        call = None
        if self.recording:
            call = self.log.add(HookCall(self.step, index, where, buffer.detach().reshape(-1).clone()))
            with counting_collectives() as count, hook_code.running(self.hook):
                fut = self.hook(state, bucket)
            call.collectives, call.group_sizes = count.issued, tuple(count.group_sizes)
        else:
            with hook_code.running(self.hook):
                fut = self.hook(state, bucket)
        if not isinstance(fut, torch._C.Future):
            # DDP raises on anything but a Future, and None kills the process (SIGSEGV with torch 2.13), the
            # finding with it: give DDP the untouched bucket instead and report the violation.
            self.fatal = True
            self._note(f"{where}: the hook returned {_describe_value(fut)}, not a torch.futures.Future; DDP needs "
                       "a Future whose value is the bucket's new contents (e.g. "
                       "dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])), and "
                       f"{_what_ddp_does_with(fut)}", step, index)
            substitute: Any = torch.futures.Future()
            substitute.set_result(buffer)
            return substitute

        def check(f: torch.futures.Future[Any]) -> Any:
            value = f.value()
            if not isinstance(value, torch.Tensor):
                hint = ""
                if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                    hint = ("; a collective's get_future() holds a list of tensors: take its first element "
                            "(.then(lambda f: f.value()[0]))")
                self._note(f"{where}: the hook's future holds {_describe_value(value)}, but DDP needs one tensor "
                           f"of shape {shape}, {dtype_name(dtype)}, on {device}{hint}", step, index)
                return value
            bad = []
            if tuple(value.shape) != shape:
                bad.append(f"shape {tuple(value.shape)} instead of {shape}")
            if value.dtype != dtype:
                bad.append(f"dtype {dtype_name(value.dtype)} instead of {dtype_name(dtype)}")
            if value.device != device:
                bad.append(f"device {value.device} instead of {device}")
            if bad:
                self._note(f"{where}: the hook's future holds a tensor with {' and '.join(bad)}: its value must "
                           "keep the bucket buffer's shape, dtype and device (DDP converts a wrong dtype "
                           "silently and fails inside its reducer on a wrong shape)", step, index)
            elif call is not None:
                call.output = value.detach().reshape(-1).clone()
            return value

        return fut.then(check)


class CppHookRecorder(Recorder):
    """The recorder of a :class:`CppCommHook`: nothing to record, so no findings of its own and no calls for the
    diagnosis; each gradient finding notes why (:data:`CPP_HOOK_NOTE`). The buckets DDP handed the hook, it reads
    after each step from DDP's own logging data (``bucket_sizes``, in bytes; a private API: nothing where this
    torch lacks it), for the case's reach (:mod:`conformance.ranks.reach`)."""

    def __init__(self, hook: CppCommHook, model: Optional[torch.nn.Module] = None):
        self.hook = hook
        self.model = model
        self.log = CallLog()

    def end_step(self, step: int) -> Optional[List[Finding]]:
        self._saw_buckets()
        return None

    def _saw_buckets(self) -> None:
        """The step's bucket sizes, from DDP's logging data, to the reach (a C++ hook's buffers are not seen)."""
        try:
            sizes = str(self.model._get_ddp_logging_data().get("bucket_sizes", ""))
        except Exception:  # noqa: BLE001 - a private API; the reach then says nothing of buffers
            return
        for size in filter(None, (s.strip() for s in sizes.split(","))):
            if size.isdigit():
                reach.saw_bytes(int(size))

    def context(self, step: int) -> str:
        return f"{self.hook.__name__}: {CPP_HOOK_NOTE}"
