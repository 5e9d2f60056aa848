"""DDP under compiled autograd (the ``compiled_autograd`` config): its training step and its hook recorder.

With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` set when it is
constructed, ``DistributedDataParallel`` leaves its C++ ``Reducer`` idle and
registers a post-accumulate-grad hook on every parameter
(``DistributedDataParallel._register_accum_grad_hook``). Under compiled
autograd that hook is traced into the backward graph, and per parameter it:

* with a comm hook registered, calls ``hook(state, (param.grad, param))`` and
  ignores what it returns: the hook must leave the reduced gradient in
  ``param.grad`` (the tuple's first element), in place. PyTorch's own hooks take
  a ``GradBucket`` (``bucket.buffer()``) and raise on the tuple;
* with none, computes ``param.grad / world_size``, a functional SUM all-reduce
  (``torch.distributed._functional_collectives.all_reduce``), and copies it back:
  the native every hook here must match
  (:class:`~conformance.apis.ddp.arithmetic.CompiledDdpArithmetic`). Eager
  DDP's C++ ``Reducer`` multiplies by ``1/world_size`` instead: the same bits
  at 2 ranks, not at 3.

Read off torch 2.13 (2.4's python reducer is the same code) and verified on
CPU with gloo and ``backend="aot_eager"``, which needs no C++ compiler. DDP
leaves global marks when it builds its python reducer
(``torch._inductor.config._fuse_ddp_communication``, Dynamo's inline list of
``torch.nn.parallel.distributed``); they change nothing an eager case does,
and are left as DDP sets them. The suite trains both
models of a case with one ``torch.compile``'d forward/backward
(:class:`CompiledTraining`) under ``torch._dynamo.config.compiled_autograd =
True``, which turns compiled autograd on while the compiled function runs, so
its ``loss.backward()`` (a graph break) runs compiled. The first step compiles
(seconds); later steps take milliseconds. Dynamo's caches are reset when a case
starts, so no case inherits another's compiled graphs or recompile count.

The hook is registered bare, ``register_comm_hook(state, hook)``, as a user
would: any Python wrapper would be traced with it, and a wrapper with side
effects recompiles every step. So the recorder (:class:`CompiledHookRecorder`)
sees no call. After each step it recomputes every parameter's local gradient
eagerly, from a plain copy of the model at the hooked model's parameters, and
logs one :class:`~conformance.ranks.hook_call.HookCall` per parameter (that
gradient in, ``param.grad`` out) for the diagnosis.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import TYPE_CHECKING, Any, Callable, ContextManager, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from conformance.apis.ddp.arithmetic import CompiledDdpArithmetic
# GRADBUCKET_NOTE: the plan's skip reason for hooks that say they take a GradBucket (PyTorch's own), and the
# start of the finding for one that only shows it when called.
from conformance.apis.ddp.plan import GRADBUCKET_NOTE, compiled_unavailable
from conformance.models import get_model
from conformance.protocol import Finding, FindingKind
from conformance.ranks import reach
from conformance.ranks.checks.common import model_no_sync
from conformance.ranks.checks.models import Recorder
from conformance.ranks.hook_call import CallLog, HookCall
from conformance.shared.compare import same_bits

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext

__all__ = ["COMPILE_BACKEND", "COMPILED_REFERENCE", "CompiledHookRecorder", "CompiledTraining",
           "compiled_ddp_missing", "convention_error", "registration_refused"]

#: ``torch.compile`` backend of the compiled cases: AOT autograd's graphs run eagerly, so no C++ compiler is
#: needed (inductor would need one on the CPU) and the kernels are eager PyTorch's.
COMPILE_BACKEND = "aot_eager"
#: What the hooked model is compared with, in messages.
COMPILED_REFERENCE = ("compiled DDP with no hook (optimize_ddp='python_reducer' under compiled autograd: "
                      "param.grad / world_size, then SUM)")
#: ``GradBucket`` methods: a hook that calls one on the tuple takes a ``GradBucket``.
_GRADBUCKET_METHODS = frozenset({"buffer", "index", "is_last", "set_buffer", "gradients", "parameters"})


def compiled_ddp_missing() -> Optional[str]:
    """What this torch lacks to train DDP under compiled autograd, or ``None``: ``torch._dynamo`` (importable,
    and supported on this Python: ``torch._dynamo.is_dynamo_supported``), ``torch._dynamo.config.compiled_autograd``
    and DDP's python reducer (:func:`~conformance.apis.ddp.plan.compiled_unavailable`, which the plan checks too)."""
    version = torch.__version__
    try:
        dynamo = importlib.import_module("torch._dynamo")
    except Exception as exc:  # noqa: BLE001 - any failure to import means no compiled DDP here
        return f"torch {version} cannot import torch._dynamo ({type(exc).__name__}: {exc})"
    supported = getattr(dynamo, "is_dynamo_supported", lambda: True)
    if not supported():
        return f"torch.compile does not support this Python or platform with torch {version}"
    if not hasattr(dynamo.config, "compiled_autograd"):
        return f"torch {version} has no torch._dynamo.config.compiled_autograd"
    return compiled_unavailable()


def _forward_backward(model: nn.Module, inputs: Tuple[torch.Tensor, ...], loss_fn: Callable[..., Any]) -> None:
    """One micro-step: forward, loss, backward (compiled as a whole; the backward is a graph break that compiled
    autograd then traces)."""
    loss_fn(inputs, model(*inputs)).backward()


class CompiledTraining:
    """One case's compiled training step, shared by its reference and hooked models.

    Constructing it resets Dynamo (``torch._dynamo.reset()``: compiled graphs, compiled autograd's cache and the
    recompile counts of earlier cases) and makes one ``torch.compile(backend=COMPILE_BACKEND)`` function under
    ``compiled_autograd=True``; :meth:`train_step` runs it with the same config, model by model.
    """

    def __init__(self) -> None:
        self._dynamo = importlib.import_module("torch._dynamo")
        self._dynamo.reset()
        with self._config():
            self._step = torch.compile(_forward_backward, backend=COMPILE_BACKEND)

    def _config(self) -> ContextManager[Any]:
        return self._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True)

    def train_step(self, ctx: CheckContext, label: str, step: int, model: nn.Module, optim: torch.optim.Optimizer,
                   inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Callable[..., torch.Tensor],
                   no_sync: Callable[[nn.Module], ContextManager[Any]] = model_no_sync) -> None:
        """:func:`~conformance.ranks.checks.common.train_step`, each micro-step's forward/backward compiled."""
        optim.zero_grad(set_to_none=True)
        for k, micro in enumerate(inputs):
            last = k == len(inputs) - 1
            ctx.phase(f"step {step}: forward/backward of the {label} model (torch.compile, backend "
                      f"{COMPILE_BACKEND}, compiled autograd)"
                      + ("" if len(inputs) == 1 else f" (micro-step {k}{'' if last else ', no_sync'})"))
            with self._config():
                if last:
                    self._step(model, micro, loss_fn)
                else:
                    with no_sync(model):
                        self._step(model, micro, loss_fn)


def _exception_text(exc: BaseException) -> str:
    """Every message of ``exc``'s chain (Dynamo wraps what a traced hook raised), joined."""
    seen: Set[int] = set()
    parts: List[str] = []
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(parts)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def convention_error(exc: BaseException) -> Optional[str]:
    """What a hook's exception says about its calling convention, or ``None`` where it says nothing of it: a
    ``GradBucket`` method called on the tuple (:data:`GRADBUCKET_NOTE`), or the tuple used as anything else."""
    text = _exception_text(exc)
    m = re.search(r"'tuple' object has no attribute '(\w+)'", text)
    if m and m.group(1) in _GRADBUCKET_METHODS:
        return (f"{GRADBUCKET_NOTE} once per parameter, with no bucket and no future, and the hook called "
                f"bucket.{m.group(1)}() on that tuple ({_first_line(text)}). Its spec says compiled_ddp=True: "
                "leave that out to have its compiled_autograd cases skipped, or serve both conventions: if "
                "isinstance(bucket, tuple): grad, param = bucket, and reduce grad in place")
    if m or "'tuple'" in text:
        return ("the hook fits neither calling convention: compiled DDP calls hook(state, (grad, param)), eager DDP "
                f"hook(state, bucket: GradBucket), and it used its second argument as neither "
                f"({_first_line(text)}); under compiled autograd unpack it: grad, param = bucket")
    return None


def registration_refused(hook: Callable[..., object], exc: BaseException) -> str:
    """The finding's text for a hook that ``DistributedDataParallel.register_comm_hook`` refused."""
    try:
        shown = f"{getattr(hook, '__qualname__', type(hook).__qualname__)}{inspect.signature(hook)}"
    except (TypeError, ValueError):
        shown = repr(hook)
    if isinstance(exc, KeyError) and exc.args == ("bucket",):
        return (f"DDP's register_comm_hook refused {shown}: it reads the hook's parameter named bucket "
                "(inspect.signature(hook).parameters['bucket'] in DistributedDataParallel._check_comm_hook), and "
                "there is none; name the second parameter bucket: compiled DDP passes (grad, param) in it, eager "
                "DDP a GradBucket")
    return f"DDP's register_comm_hook refused {shown}: {type(exc).__name__}: {_first_line(str(exc))}"


class CompiledHookRecorder(Recorder):
    """What the suite sees of a hook registered bare with compiled DDP: no call, only the gradients it leaves.

    :meth:`step_failed` turns the hook's exceptions about its calling convention
    (:func:`convention_error`), and :meth:`begin_step` a registration DDP refused
    (:func:`registration_refused`), into findings of kind ``"contract"``; others
    propagate. After each step it logs one :class:`HookCall` per parameter: the
    local gradient recomputed eagerly by ``plain`` (the reference model class,
    loaded with the hooked model's parameters before the optimizer step) and
    the hooked ``param.grad``. :meth:`findings` (collective) reports the
    parameters whose gradient the hook left as it was on every rank (compiled
    DDP ignores what the hook returns) and keeps that step out of the
    diagnosis, which would call them "never communicated": it cannot count a
    traced hook's collectives.

    Attributes:
        refused: why DDP refused to register the hook, or ``None``.
    """

    def __init__(self, hook: Callable[..., object], ctx: CheckContext, model: nn.Module, model_name: str,
                 inputs: Sequence[Tuple[torch.Tensor, ...]], loss_fn: Callable[..., Any]):
        self.hook = hook
        self.ctx = ctx
        self.model = model
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.plain = get_model(model_name).build(group=ctx.group, device=ctx.device, fsdp_kwargs=None)
        self.log = CallLog()
        self.refused: Optional[str] = None

    def refuse(self, exc: BaseException) -> None:
        """DDP refused to register the hook (``register_comm_hook`` raised ``exc``)."""
        self.refused = registration_refused(self.hook, exc)

    def begin_step(self, step: int) -> Optional[List[Finding]]:
        super().begin_step(step)
        if self.refused is not None:
            return [Finding(self.ctx.rank, self.refused, step=step, kind=FindingKind.CONTRACT)]
        return None

    def step_failed(self, step: int, exc: Exception) -> Optional[List[Finding]]:
        """A failure about the calling convention is a contract finding; any other propagates."""
        why = convention_error(exc)
        return None if why is None else [Finding(self.ctx.rank, why, step=step, kind=FindingKind.CONTRACT)]

    def end_step(self, step: int) -> Optional[List[Finding]]:
        self._record(step)
        return None

    def _record(self, step: int) -> None:
        """Log this step's calls: per parameter with a gradient, the eagerly recomputed local gradient and the
        hooked model's gradient after the step's backward."""
        self.ctx.phase(f"step {step}: recomputing the local gradients eagerly (for the diagnosis)")
        module = getattr(self.model, "module", self.model)
        with torch.no_grad():
            for dst, src in zip(self.plain.parameters(), module.parameters()):
                dst.copy_(src)
        self.plain.zero_grad(set_to_none=True)
        for micro in self.inputs:
            self.loss_fn(micro, self.plain(*micro)).backward()
        for index, ((name, p), q) in enumerate(zip(module.named_parameters(), self.plain.parameters())):
            if p.grad is None or q.grad is None:
                continue
            reach.saw_buffer(p.grad)  # compiled DDP hands the hook each parameter's gradient
            self.log.add(HookCall(step, index, f"parameter {name}", q.grad.detach().reshape(-1).clone(),
                                  output=p.grad.detach().reshape(-1).clone()))

    def findings(self, step: int) -> List[Finding]:
        """One finding (kind ``"contract"``) naming the parameters whose gradient the hook left as it was on every
        rank where native's average differs from it on some rank; the step's calls then leave the log (this is
        the diagnosis). Collective: an all-reduce of the flags, then native's own all-reduce of each call left
        unchanged everywhere, then one of the verdicts."""
        calls = [c for c in self.log.calls if c.step == step]
        if not calls:
            return []
        group, device = self.ctx.group, self.ctx.device
        unchanged = torch.tensor([int(same_bits(c.output, c.input)) for c in calls], dtype=torch.int64, device=device)
        dist.all_reduce(unchanged, op=dist.ReduceOp.MIN, group=group)
        suspects = [c for c, u in zip(calls, unchanged.tolist()) if u]
        if not suspects:
            return []
        native = CompiledDdpArithmetic(dist.get_world_size(group), None)
        differs = torch.tensor([int(not same_bits(native.native_result(c, group), c.output)) for c in suspects],
                               dtype=torch.int64, device=device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
        left = [c for c, d in zip(suspects, differs.tolist()) if d]
        if not left:
            return []
        # The step leaves the diagnosis: its other calls alone would read as "the hook's own result equals
        # native's arithmetic in every call".
        self.log.calls = [c for c in self.log.calls if c.step != step]
        names = ", ".join(c.where.split(" ", 1)[1] for c in left[:3]) + (", ..." if len(left) > 3 else "")
        which = ("every parameter" if len(left) == len(calls) else
                 f"{len(left)} of {len(calls)} parameters ({names})")
        ws = native.world_size
        return [Finding(self.ctx.rank, f"after the hook, the gradient of {which} still holds this rank's local, "
                                       "unreduced gradient on every rank, where native's average differs from it: "
                                       "compiled DDP calls hook(state, (grad, param)) for each parameter, ignores "
                                       "what the hook returns, and keeps only what it leaves in grad (bucket[0], "
                                       f"which is param.grad); reduce it in place: grad.div_({ws}); "
                                       "dist.all_reduce(grad, group=...)", step=step, kind=FindingKind.CONTRACT)]
