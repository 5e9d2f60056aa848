"""DDP's future contract, as the suite records it: what a ``DistributedDataParallel`` comm hook must return.

``DistributedDataParallel.register_comm_hook(state, hook)``: DDP calls
``hook(state, bucket)`` once per gradient bucket of a synchronising backward,
and the hook returns a ``torch.futures.Future`` whose value is one tensor with
the shape, dtype and device of ``bucket.buffer()``. DDP copies whatever it gets
into the gradients, converting dtypes silently, and fails deep inside its
reducer on a wrong shape or a value that is not a tensor. :class:`DDPHookRecorder`
stands between DDP and the hook under test and writes a finding first;
:func:`hooked_step` turns DDP's later failure into that finding;
:func:`hook_called` says when DDP never called the hook. The rank check
``ddp.future_contract`` (:func:`future_contract`) trains with the recorder and
also registers the bare hook, as DDP's own checks see it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from conformance.ranks.checks import rank_check
from conformance.ranks.compare import dtype_name
from conformance.ranks.diagnosis import CallLog, HookCall, counting_collectives
from conformance.protocol import Finding


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {dtype_name(value.dtype)}, on {value.device}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe_value(v) for v in list(value)[:2])
        more = ", ..." if len(value) > 2 else ""
        return f"a {type(value).__name__} of {len(value)} ({inner}{more})"
    if value is None:
        return "None"
    return f"a {type(value).__name__} ({value!r:.60})"


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


class DDPHookRecorder:
    """Calls the hook under test for DDP and checks the future it returns.

    The contract (``DistributedDataParallel.register_comm_hook``): the hook
    returns a ``torch.futures.Future`` whose value is one tensor with the shape,
    dtype and device of ``bucket.buffer()`` as DDP handed it to the hook. DDP
    itself copies whatever it gets into the gradients, converting dtypes
    silently, and fails deep inside its reducer on a wrong shape or a value
    that is not a tensor; the recorder writes a :class:`Finding` first, so a
    check can report that instead of the reducer's error.

    Attributes:
        step: the training step, set by the check before each backward.
        calls: ``(step, bucket index)`` per hook call.
        findings: contract violations seen so far.
        fatal: the hook returned something that is not a Future. DDP would
            crash the process on it (SIGSEGV with torch 2.13), so the recorder
            hands DDP a completed Future holding the untouched bucket instead,
            and the check stops with the finding.
    """

    def __init__(self, hook: Any, rank: int, names: Dict[int, str]):
        self.hook = hook
        self.rank = rank
        self.names = names
        self.step = 0
        self.calls: List[Tuple[int, int]] = []
        self.findings: List[Finding] = []
        self.fatal = False
        self.log = CallLog()
        # DDP's register_comm_hook reads hook.__qualname__ (for its logger) and hook.__name__ (it refuses
        # the bf16 hooks by name where NCCL is missing): answer as the hook would, so DDP treats the
        # recorder as it treats the hook. Whether DDP accepts the bare hook is checked on its own.
        self.__qualname__ = getattr(hook, "__qualname__", type(hook).__qualname__)
        self.__name__ = getattr(hook, "__name__", type(hook).__name__)

    def findings_of(self, step: int) -> List[Finding]:
        """The contract violations recorded in ``step``: reported even where DDP went on without an error
        (a future longer than the bucket, whose leading elements DDP reads)."""
        return [f for f in self.findings if f.step == step]

    def _bucket_text(self, bucket: Any, index: int) -> str:
        try:
            params = [self.names.get(id(p), "?") for p in bucket.parameters()]
        except Exception:  # noqa: BLE001 - older GradBucket without parameters()
            params = []
        shown = ", ".join(params[:3]) + (f", ... ({len(params)} parameters)" if len(params) > 3 else "")
        return f"bucket {index}" + (f" [{shown}]" if shown else "")

    def _note(self, message: str) -> None:
        if len(self.findings) < 20:
            self.findings.append(Finding(self.rank, message, step=self.step))

    # No annotations: DDP's _check_comm_hook compares them with dist.GradBucket, and under
    # ``from __future__ import annotations`` they would be strings.
    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        index = bucket.index()
        shape, dtype, device = tuple(buffer.shape), buffer.dtype, buffer.device
        where = self._bucket_text(bucket, index)
        self.calls.append((self.step, index))
        call = self.log.add(HookCall(self.step, index, where, buffer.detach().reshape(-1).clone()))
        with counting_collectives() as count:
            fut = self.hook(state, bucket)
        call.collectives = count[0]
        if not isinstance(fut, torch._C.Future):
            # Handing DDP anything but a Future kills the process (SIGSEGV with torch 2.13), and the
            # finding with it: give DDP the untouched bucket instead and report the violation.
            self.fatal = True
            self._note(f"{where}: the hook returned {_describe_value(fut)}, not a torch.futures.Future; DDP needs "
                       "a Future whose value is the bucket's new contents (e.g. "
                       "dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])), and "
                       "crashes the process without one")
            substitute: Any = torch.futures.Future()
            substitute.set_result(buffer)
            return substitute

        def check(f: Any) -> Any:
            value = f.value()
            if not isinstance(value, torch.Tensor):
                hint = ""
                if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                    hint = ("; a collective's get_future() holds a list of tensors: take its first element "
                            "(.then(lambda f: f.value()[0]))")
                self._note(f"{where}: the hook's future holds {_describe_value(value)}, but DDP needs one tensor "
                           f"of shape {shape}, {dtype_name(dtype)}, on {device}{hint}")
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
                           "silently and fails inside its reducer on a wrong shape)")
            else:
                call.output = value.detach().reshape(-1).clone()
            return value

        return fut.then(check)


def hooked_step(ctx: Any, recorder: DDPHookRecorder, step: int, run: Callable[[], None]) -> Optional[List[Finding]]:
    """Run one training step of the hooked model; the contract findings if the hook broke DDP's contract
    in a way that makes the step meaningless, else ``None``.

    A DDP failure after a recorded contract violation (a list, a wrong shape)
    becomes that violation plus one line with DDP's own error; a failure with
    no violation recorded (the hook itself raised) propagates unchanged.
    """
    recorder.step = step
    try:
        run()
    except Exception as exc:  # noqa: BLE001
        if not recorder.findings:
            raise
        return list(recorder.findings) + [Finding(
            ctx.rank, f"DDP then failed while using the hook's result: {_short_error(exc)}", step=step)]
    if recorder.fatal:
        return list(recorder.findings)
    return None


def hook_called(ctx: Any, recorder: DDPHookRecorder, step: int) -> List[Finding]:
    if any(s == step for s, _ in recorder.calls):
        return []
    return [Finding(ctx.rank, "DDP never called the hook in this synchronising step", step=step)]


# -- the check -------------------------------------------------------------------------

def _bare_registration(ctx: Any, spec: Any) -> List[Finding]:
    """DDP must accept the hook itself: ``register_comm_hook`` inspects its signature and name."""
    from conformance.apis.ddp.adapter import build_ddp

    model = build_ddp("analytic_linear", ctx, "default")
    try:
        model.register_comm_hook(spec.state(ctx.group), spec.hook)
    except Exception as exc:  # noqa: BLE001
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyError) and "bucket" in str(exc):
            hint = ("DDP looks the second parameter up by name: call it 'bucket', as in "
                    "hook(state, bucket: dist.GradBucket)")
        elif isinstance(exc, AttributeError) and ("__qualname__" in str(exc) or "__name__" in str(exc)):
            hint = ("DDP reads hook.__name__ and hook.__qualname__, which instances of a class do not have: "
                    "set them, e.g. self.__name__ = self.__qualname__ = type(self).__qualname__ in __init__")
        else:
            hint = "see DistributedDataParallel.register_comm_hook for what it accepts"
        return [Finding(ctx.rank, f"DistributedDataParallel.register_comm_hook rejects the hook: {text}; {hint}")]
    return []


@rank_check("ddp.future_contract")
def future_contract(ctx: Any, spec: Any, *, config: str, model: str, steps: int = 4,
                    lr: float = 0.01) -> List[Finding]:
    """DDP accepts the bare hook; each future holds one tensor like the bucket buffer; every step calls it.

    In the ``small_buckets`` config the model must span several buckets from
    the second step on (else the config tests nothing and the check raises).
    """
    from conformance.apis.ddp.adapter import build_hooked, micro_inputs, train_step
    from conformance.models import get_model

    ctx.phase("registering the bare hook on a DDP model")
    findings = _bare_registration(ctx, spec)
    model_cls = get_model(model)
    ctx.phase("building the hooked DDP model")
    hooked, recorder = build_hooked(spec, model, ctx, config)
    optim = torch.optim.SGD(hooked.parameters(), lr=lr, momentum=0.9)
    inputs = micro_inputs(model_cls, ctx, config)
    for step in range(steps):
        broken = hooked_step(ctx, recorder, step,
                             lambda: train_step(ctx, "hooked", step, hooked, optim, inputs, model_cls.loss))
        if broken:
            return findings + broken
        findings += hook_called(ctx, recorder, step)
        if ctx.any_rank(bool(findings) or bool(recorder.findings)):
            return findings + recorder.findings
        optim.step()
    if config in ("small_buckets", "bucket_per_param"):
        buckets = max((len({i for s, i in recorder.calls if s == step}) for step in range(steps)), default=0)
        if buckets < 2:
            raise RuntimeError(f"the {config} config gave {buckets} bucket(s) for model {model!r}; "
                               "the suite needs a smaller bucket cap or a larger model")
    return findings
