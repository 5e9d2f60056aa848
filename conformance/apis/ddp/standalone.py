"""DDP's part of a standalone reproducer (torch only): its training configs, its reference per claim, its build.

A reproducer of a DDP case holds what the case runs of this module
(:mod:`conformance.reproducers.sources`: an ``if`` on ``CASE`` as the branch the
case takes, the config's constructor keywords as ``DDP_KWARGS``,
:func:`reproducer_constants`); the suite's rank side imports its configs and
reference hooks from here (``models.py``), so the file builds the
models exactly as the suite did. Its functions read the reproducer's globals
``CASE`` (``variant["config"]``, ``reduce_dtype``), ``DDP_KWARGS``, ``MODEL``,
``HOOK`` and ``STATE`` only when called.

The ``compiled_autograd`` config (:data:`COMPILED_CONFIG`) builds DDP with its
python reducer; the suite compiles its training, a reproducer runs it eagerly
(the same calls of the hook, untraced).

The reference for each claim: DDP with no hook (``Reducer``: the gradient
copied into the bucket multiplied by ``1/world_size``, SUM all-reduce; in the
``batched_grad_copy`` config the gradients copied as they are and the flat
bucket divided by the world size, ``Reducer``'s batched copy); for
``reduce_dtype=float16`` / ``bfloat16`` the documented equivalent
``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``
(``ddp_comm_hooks/default_hooks.py``); another reduce dtype: cast, ``allreduce_hook``, cast back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # pragma: no cover - the loop's type; a reproducer defines it (standalone_main.py)
    from conformance.shared.standalone_main import Ranks

#: ``bucket_cap_mb`` of the ``small_buckets`` config: 512 bytes, so every
#: reference model spreads over several buckets once DDP rebuilds its buckets
#: after the first iteration (the first iteration always uses one bucket).
SMALL_BUCKET_CAP_MB = 512 / (1024 * 1024)
#: ``bucket_cap_mb`` of the ``bucket_per_param`` config: one byte, so from the
#: second iteration on every parameter is a bucket of its own, and the buckets
#: of ``gradient_probe`` (numels 3, 1, 5, 21, 64) have lengths that divide by
#: neither 2 nor 3 ranks (a hook that pads a bucket must not hand the padding back).
BUCKET_PER_PARAM_CAP_MB = 1 / (1024 * 1024)
#: Backward passes per step in the ``no_sync`` config: all but the last run
#: under ``no_sync()`` (no hook call), the last one synchronises.
NO_SYNC_MICRO_STEPS = 3
#: The config of DDP under compiled autograd: DDP built with ``torch._dynamo.config.optimize_ddp =
#: "python_reducer"``, whose post-accumulate-grad hooks call ``hook(state, (grad, param))`` once per
#: parameter and ignore what it returns (planned only with ``--with-compiled-ddp``). The suite trains it
#: with ``torch.compile`` and compiled autograd (:mod:`conformance.apis.ddp.compiled`); a standalone
#: reproducer trains it eagerly, where the same hooks call the hook the same way, untraced.
COMPILED_CONFIG = "compiled_autograd"

#: Training configurations: DDP constructor keyword arguments (:data:`ALL_CONFIGS` adds :data:`COMPILED_CONFIG`).
CONFIGS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "small_buckets": {"bucket_cap_mb": SMALL_BUCKET_CAP_MB},
    "bucket_per_param": {"bucket_cap_mb": BUCKET_PER_PARAM_CAP_MB},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    # torch 2.10+: with unused parameters found, DDP reduces none of theirs (they must stay unused on every rank).
    "skip_unused": {"find_unused_parameters": True, "skip_all_reduce_unused_params": True},
    # DDP defers each gradient's copy into its bucket and flushes them as one _foreach_copy_; with no hook it then
    # divides the flat bucket by the world size (a divide, where the default multiplies each gradient by
    # 1/world_size as it copies it: other bits at 3 ranks). With a hook, the bucket is handed over undivided.
    "batched_grad_copy": {"batched_grad_copy": True},
    "no_sync": {},
    "subgroup": {},
}
#: Every config a DDP case may have: :data:`CONFIGS`, and :data:`COMPILED_CONFIG` (DDP's default
#: constructor arguments, with the python reducer).
ALL_CONFIGS = (*CONFIGS, COMPILED_CONFIG)


def micro_steps(variant: Dict[str, Any], asked: int) -> int:
    """Backward passes per step of a case: :data:`NO_SYNC_MICRO_STEPS` in the ``no_sync`` config."""
    return NO_SYNC_MICRO_STEPS if variant.get("config") == "no_sync" else asked


def wrap_ddp(module: nn.Module, group: Optional[torch.distributed.ProcessGroup], device: torch.device, config: str, *,
             batched: bool = False) -> nn.Module:
    """``DistributedDataParallel(module)`` in ``group`` under ``config`` (:data:`ALL_CONFIGS`), with
    ``batched_grad_copy=True`` besides where ``batched``; for :data:`COMPILED_CONFIG`, constructed under
    ``torch._dynamo.config.patch(optimize_ddp="python_reducer")``, which DDP reads in its constructor
    (``_use_python_reducer``).

    Raises:
        ValueError: ``config`` is not one of :data:`ALL_CONFIGS`.
    """
    if config not in ALL_CONFIGS:
        raise ValueError(f"unknown DDP config {config!r}; known: {', '.join(ALL_CONFIGS)}")
    device_ids = [device] if device.type == "cuda" else None
    if config == COMPILED_CONFIG:
        from torch._dynamo import config as dynamo_config  # only here: only this config needs torch._dynamo

        with dynamo_config.patch(optimize_ddp="python_reducer"):
            return DistributedDataParallel(module, device_ids=device_ids, process_group=group)
    options = {**CONFIGS[config], **({"batched_grad_copy": True} if batched else {})}
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group, **options)


def in_param_dtype(module: nn.Module, dtype: Optional[torch.dtype]) -> nn.Module:
    """``module`` trained in a claimed parameter dtype, as pure low-precision training does: its parameters and
    floating buffers cast with ``module.to(dtype)``, and a forward pre-hook that casts its floating-point tensor
    inputs to ``dtype`` (integer inputs, token ids, are left alone); ``dtype=None``: ``module`` unchanged."""
    if dtype is None:
        return module

    def cast_inputs(_module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    module.to(dtype).register_forward_pre_hook(cast_inputs)
    return module


def _identity_state(process_group: Optional[torch.distributed.ProcessGroup]) -> Any:
    return process_group


class _CastAllreduce:
    """Cast the bucket to ``dtype``, ``allreduce_hook``, cast back: the ``*_compress_wrapper`` shape.

    Only for reduce dtypes PyTorch has no wrapper for (float32 / float64
    claims on parameters of another dtype).
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        # DDP's register_comm_hook reads the hook's __name__ (_check_comm_hook) and __qualname__ (its logger)
        self.__name__ = self.__qualname__ = f"cast_allreduce_{str(dtype).rsplit('.', 1)[-1]}"

    def __call__(self, state, bucket):  # unannotated: DDP checks any annotation against GradBucket/Future
        out = bucket.buffer()
        bucket.set_buffer(out.to(self.dtype))
        fut = default_hooks.allreduce_hook(state, bucket)
        return fut.then(lambda f: out.copy_(f.value()))


def reference_hook(reduce_dtype: Optional[torch.dtype], param_dtype: torch.dtype
                   ) -> Optional[Tuple[Callable[[Any], Any], Any]]:
    """``(state_factory, hook)`` of the reference for a claim; ``None`` = DDP with no hook.

    ``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``
    for float16 / bfloat16, which PyTorch's docstrings state equal
    ``fp16_compress_hook`` / ``bf16_compress_hook``; ``allreduce_hook``'s
    state is the process group.
    """
    if reduce_dtype is None or reduce_dtype == param_dtype:
        return None
    if reduce_dtype == torch.float16:
        return _identity_state, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    if reduce_dtype == torch.bfloat16:
        return _identity_state, _renamed(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
                                         "reference_bf16_compress_wrapper_allreduce")
    return _identity_state, _CastAllreduce(reduce_dtype)


def _renamed(hook: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``hook`` under another ``__name__``.

    ``DistributedDataParallel._check_comm_hook`` refuses any hook *named*
    ``bf16_compress_hook`` or ``bf16_compress_wrapper_hook`` on a torch built
    without CUDA/NCCL, although gloo reduces bfloat16. The suite's own reference
    must run wherever the hook under test can, so it goes by another name; the
    arithmetic is PyTorch's, unchanged.
    """

    def reference(state, bucket):  # unannotated: DDP checks any annotation against GradBucket/Future
        return hook(state, bucket)

    reference.__name__ = reference.__qualname__ = name
    return reference


# -- the reproducer's side (reads its globals when called) ---------------------------------------------------

def reference(case: Dict[str, Any]) -> str:
    """What the hooked copy of ``case`` (a reproducer's ``CASE``) is compared with: DDP with no hook, or the claim's
    documented equivalent."""
    if case.get("param_dtype") is not None:
        return f"DDP with the model in {case['param_dtype']}, reduce_dtype={case['reduce_dtype']}"
    if case["variant"].get("config") == COMPILED_CONFIG:
        return "DDP's python reducer with no hook (param.grad / world_size, then SUM; run eagerly here)"
    if case["reduce_dtype"] in (torch.float16, torch.bfloat16):
        name = "fp16" if case["reduce_dtype"] == torch.float16 else "bf16"
        return f"the documented equivalent, {name}_compress_wrapper(allreduce_hook)"
    if case["reduce_dtype"] is not None:
        return f"allreduce_hook in {case['reduce_dtype']}"
    batched = case.get("native") == "batched_grad_copy" or case["variant"].get("config") == "batched_grad_copy"
    return "DDP with batched_grad_copy=True and no hook" if batched else "DDP with no hook"


def reproducer_constants(case: Dict[str, Any]) -> Dict[str, Any]:
    """What a reproducer of ``case`` binds beside its ``CASE``: ``DDP_KWARGS``, the DDP constructor's keyword
    arguments of its config (:data:`CONFIGS`; none for :data:`COMPILED_CONFIG`), with ``batched_grad_copy=True``
    where the case's ``native`` is DDP's batched copy, and ``REFERENCE`` (:func:`reference`)."""
    options = dict(CONFIGS.get(case["variant"].get("config"), {}))
    if case.get("native") == "batched_grad_copy" and case["variant"].get("config") != COMPILED_CONFIG:
        options["batched_grad_copy"] = True  # a spec meant for DDP's batched copy alone: every config with it
    return {"DDP_KWARGS": options, "REFERENCE": reference(case)}


def subgroup(ranks: Ranks) -> Ranks:
    """The ``subgroup`` config trains in this rank's data-parallel subgroup (:func:`data_parallel_groups`)."""
    if CASE["variant"]["config"] == "subgroup":
        return on_data_parallel_subgroup(ranks)
    return ranks


def build(ranks: Ranks, hooked: bool) -> nn.Module:
    """The case's DDP model (``DDP_KWARGS``): with ``hooked``, ``register_comm_hook(STATE(group), HOOK)``; else
    native's reference (the claim's reference hook, for a reduce dtype other than the parameters')."""
    module = MODEL.plain(group=ranks.group, device=ranks.device)
    if CASE.get("param_dtype") is not None:
        module = in_param_dtype(module, CASE["param_dtype"])
    if CASE["variant"]["config"] == COMPILED_CONFIG:
        model = wrap_ddp(module, ranks.group, ranks.device, COMPILED_CONFIG)
    else:
        model = DistributedDataParallel(module, device_ids=[ranks.device] if ranks.device.type == "cuda" else None,
                                        process_group=ranks.group, **DDP_KWARGS)
    if hooked:
        model.register_comm_hook(STATE(ranks.group), HOOK)
    elif CASE["reduce_dtype"] is not None:
        ref = reference_hook(CASE["reduce_dtype"], next(model.parameters()).dtype)
        if ref is not None:
            model.register_comm_hook(ref[0](ranks.group), ref[1])
    return model


def no_sync(model: nn.Module) -> Any:
    """``DistributedDataParallel.no_sync()``."""
    return model.no_sync()


GRADIENT, PARAMETER = "gradient", "parameter after the optimizer step"


def tensors(model: nn.Module, what: str) -> Dict[str, Any]:
    """``{FQN: tensor}`` of ``model`` (FQNs as in the model DDP wraps, less DDP's ``module.``): each parameter's
    gradient (``GRADIENT``) or the parameter itself (``PARAMETER``)."""
    return {n.removeprefix("module."): p.grad if what == GRADIENT else p for n, p in model.named_parameters()}
