"""The rank side of one hook API: :class:`ApiModels`, what every shared rank check is written over.

A shared check (averaging, parity, clip_grad_norm_, hard inputs, rank
gradients in :mod:`conformance.ranks.checks.exact`; the lossy contracts in
:mod:`conformance.ranks.checks.lossy`) knows no API. It asks the case's
:class:`ApiModels` for the reference model or the hooked one
(``build(hooked=False)`` is the reference, as ``hook_type=None`` is in
``_get_grads(process_group, hook_type=None)`` of PyTorch's
``test_ddp_hooks.py``), the inputs of a step, the views of gradients and
parameters, and the API's native arithmetic for the diagnosis. Each hook API
subclasses it in its folder (``conformance/apis/<api>/models.py``); its
:class:`~conformance.apis.HookApi` names the subclass (``models``), and the
registry binds every shared check its suite tests run to it
(:func:`conformance.ranks.checks.get_rank_check`).

The hooked model comes with its :class:`Recorder`: the API's wrapper around the
hook under test, which keeps every call for the diagnosis and says what the hook
broke of the API's contract.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from conformance.models import get_model
from conformance.protocol import Finding
from conformance.ranks import reach
from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.checks.common import (View, clip_with_torch, model_no_sync, named_grads, named_params,
                                             train_step)
from conformance.ranks.hook_call import CallLog

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

__all__ = ["ApiModels", "Built", "MakeModels", "NativeDoesNotHold", "Recorder"]


class NativeDoesNotHold(RuntimeError):
    """The reference failed the API's analytic check (:meth:`ApiModels.check_reference`): its gradients are not
    the exact reduction of every rank's inputs. Raised while the reference trains, so the runner replays the
    reference alone and, where it fails there too, skips the case with this message: a native path that is
    itself wrong (NCCL's bfloat16 ``PREMUL_SUM`` returning zeros, PyTorch issue 190745) never blesses a hook."""


class Recorder:
    """What an API's recorder (its wrapper around the hook under test) tells the shared checks.

    Attributes:
        step: the training step, set by :meth:`begin_step` before the step's backward passes.
        log: the hook's calls (:class:`~conformance.ranks.hook_call.CallLog`), for the diagnosis.
        recording: keep each call's input and result in :attr:`log` (a copy of every buffer, and the
            collectives counted); ``False`` in a long run's unrecorded pass
            (:mod:`conformance.ranks.checks.long_run`), which replays a difference with it on. The contract
            findings are kept either way, and every call reports its buffer to :mod:`conformance.ranks.reach`.
    """

    step: int = 0
    log: CallLog
    recording: bool = True

    def begin_step(self, step: int) -> Optional[List[Finding]]:
        """Before the hooked model's training step ``step``
        (:func:`~conformance.ranks.checks.common.hooked_step`): the findings that end the check before it
        trains (DDP refused the hook), else ``None``. Here: notes the step."""
        self.step = step
        reach.saw_step(step)
        return None

    def step_failed(self, step: int, exc: Exception) -> Optional[List[Finding]]:
        """The hooked model's training step raised ``exc``: the findings it means where the hook broke the API's
        contract first (DDP's future), or ``None``: ``exc`` propagates, the hook's error. Here: ``None``."""
        return None

    def end_step(self, step: int) -> Optional[List[Finding]]:
        """After the hooked model's training step: the findings that end the check where the hook broke the API's
        contract so that the step means nothing (DDP's future), else ``None``. Here: ``None``."""
        return None

    def findings(self, step: int) -> List[Finding]:
        """What the recorder saw the hook break in the finished ``step`` (a wrong dtype, never called)."""
        return []

    def findings_so_far(self, step: int) -> List[Finding]:
        """What it has seen go wrong in ``step`` so far, never what only a finished step shows; reported
        above the traceback when the step raises."""
        return []

    def context(self, step: int) -> str:
        """A note for the step's gradient findings (what FSDP2 passed the comm), or ``""``."""
        return ""

    def unused(self) -> Optional[str]:
        """Why the API never called the hook in any step where that is its design (an FSDP2 comm under
        ``replicate``, which has no shard group), or ``None``: a finding of kind ``"hook_not_called"``
        once the training matched."""
        return None


@dataclasses.dataclass
class Built:
    """A model a check built: the reference (``recorder`` is ``None``) or the hooked model and its recorder."""

    model: nn.Module
    recorder: Optional[Recorder] = None


class ApiModels(abc.ABC):
    """One case's models under one hook API, on one rank: ``Models(ctx, spec, model=..., **variant)``.

    Every rank constructs it at the same point (building a model may be
    collective: device meshes, subgroups). ``variant`` is the case's variant
    under the API's field name (``strategy=``, ``config=``) and the suite
    test's own parameters (FSDP1's ``low_precision_grads``, ``subgroup``).

    Attributes:
        ctx: the rank context the models train in; for a subgroup case, the
            subgroup's (:func:`conformance.ranks.checks.groups.on_subgroup`).
        spec: the hook's spec.
        model_cls: the reference model class (``conformance.models``): ``build``, ``make_input``, ``loss``.
        inputs: this rank's inputs of one step, one tuple per backward pass
            (:attr:`micro_steps`; each ``make_input(rank + k * world_size)``, rank-dependent and distinct).
        reference: what the hooked model is compared with, in messages (``"DDP with no hook"``).
        arithmetic: the API's native arithmetic for the hook's claim, which the diagnosis recomputes.
        grad_views: the gradient views compared bitwise after each backward in lock step, in order
            (FSDP2: the local shards, then the full tensors).
        param_view: the parameter view compared after each optimizer step.
        micro_steps: backward passes per step (DDP's ``no_sync`` config, and every API's accumulation cases:
            several; all but the last under :meth:`no_sync`).
        empty_shards: a parameter's local gradient may be an empty shard (FSDP1), which averaging skips.
        clips_without_backward: the clip check ends with a forward and no backward (FSDP1's
            ``clip_grad_norm_`` warns and returns a float32 zero, as PyTorch's ``test_no_gradients`` pins).
    """

    micro_steps = 1
    empty_shards = False
    clips_without_backward = False
    reference: str
    arithmetic: Arithmetic
    grad_views: Sequence[View]
    param_view: View

    def __init__(self, ctx: CheckContext, spec: HookSpec, model: str):
        self.ctx = ctx
        self.spec = spec
        self.model_name = model
        self.model_cls = get_model(model)
        self._inputs: Optional[List[Tuple[torch.Tensor, ...]]] = None

    @property
    def inputs(self) -> List[Tuple[torch.Tensor, ...]]:
        """This rank's inputs of one step, made on first use (a check that feeds its own, the hard inputs and the
        long run, never pays for them: tens of MiB for the probe of production size)."""
        if self._inputs is None:
            ctx = self.ctx
            self._inputs = [self.model_cls.make_input(ctx.rank + k * ctx.world_size, ctx.world_size, ctx.device)
                            for k in range(self.micro_steps)]
        return self._inputs

    @abc.abstractmethod
    def build(self, hooked: bool = False, *, full_precision: bool = False) -> Built:
        """A fresh model of the case under the API, announced as a phase: with ``hooked``, the hook under test
        installed through its recorder (fresh hook state); else the reference, the native path for the
        hook's claim (``full_precision``: with no reduce dtype, the lossy loss's reference)."""

    def check_reference(self, model: nn.Module, inputs: Sequence[Tuple[torch.Tensor, ...]], step: int) -> None:
        """After the reference's backward of ``step`` (before its optimizer step), check its gradients against
        the exact reduction computed from every rank's ``inputs``, where the API has such a check (FSDP2's
        divide factors); collective where it checks. Here: nothing.

        Raises:
            NativeDoesNotHold: the reference's gradients are not that reduction.
        """

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """The API's gradient accumulation, around every micro-step's backward but the last: no hook call,
        gradients accumulated locally (:func:`~conformance.ranks.checks.common.train_step`). Here
        ``model.no_sync()``, DDP's and FSDP1's (``DistributedDataParallel.no_sync``,
        ``FullyShardedDataParallel.no_sync``); FSDP2's models override it."""
        return model_no_sync(model)

    @property
    def train_step(self) -> Callable[..., None]:
        """The training step of the API's models, ``train(ctx, label, step, model, optim, inputs, loss_fn,
        no_sync=...)``, in lock step (:meth:`~conformance.ranks.checks.lockstep.Lockstep.of`) and when the
        reference is replayed alone: here :func:`~conformance.ranks.checks.common.train_step` itself (no frame
        of its own between the check and the training). DDP's ``compiled_autograd`` config compiles it."""
        return train_step

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor]:
        """``loss_fn(inputs, output)`` of the reference model class."""
        return self.model_cls.loss

    @property
    def reduce_dtype(self) -> Optional[torch.dtype]:
        """The hook's claimed reduce dtype: gradient mismatches count their ULPs in it too."""
        return self.spec.reduce_dtype

    @property
    def reference_dtypes(self) -> Tuple[torch.dtype, ...]:
        """The dtype the reference (the native path for the hook's claim) sends where native with no reduce dtype
        sends the gradients' own: the claimed reduce dtype, where it is not the parameters' (a claimed parameter
        dtype is the user's model, whatever the hook). What a step's cost counts as float32 on the reference's
        side (:func:`conformance.ranks.cost.summarise`)."""
        reduce_dtype = self.spec.reduce_dtype
        params = getattr(self.spec, "param_dtype", None) or torch.float32
        return () if reduce_dtype is None or reduce_dtype == params else (reduce_dtype,)

    @property
    def noun(self) -> str:
        """What the model is called in phases: ``"analytic model"``, ``"probe"``, else ``"model"``."""
        return {"analytic_linear": "analytic model", "gradient_probe": "probe"}.get(self.model_name, "model")

    def local_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        """``{fqn: this rank's gradient or local shard}``, no collective."""
        return named_grads(model)

    def full_grads(self, model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        """``{fqn: full (unsharded) gradient or None}``; collective where sharded, so every rank calls it in order."""
        return self.local_grads(model)

    def full_params(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """``{fqn: full parameter}``, collective likewise."""
        return named_params(model)

    def forward(self, model: nn.Module) -> nn.Module:
        """The module whose forward gives the loss (DDP: ``model.module``)."""
        return model

    def clip(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """The API's ``clip_grad_norm_`` over ``model``; the total norm as a plain tensor."""
        return clip_with_torch(model, max_norm, norm_type)

    def reference_average(self, hooked: nn.Module) -> Optional[str]:
        """Where the averaging check's expected value is not the exact mean but what the reference computes
        (DDP under a reduced-precision claim), what that is, for messages; else ``None``."""
        return None


#: ``make(ctx, spec, model=..., **variant) -> ApiModels``: an API's models class.
MakeModels = Callable[..., ApiModels]
