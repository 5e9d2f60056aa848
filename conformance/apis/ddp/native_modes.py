"""DDP's native modes: the constructor options that change DDP's own averaging, which a hook must then match.

``batched_grad_copy=True`` (a ``DistributedDataParallel`` argument since torch 2.13): DDP's ``Reducer`` defers
each gradient's copy into its bucket and flushes a bucket as one ``_foreach_copy_``; with no hook it then
divides the flat bucket by the world size (``bucket.gradients.div_(div_factor)``), where by default it
multiplies each gradient by ``1/world_size`` as it copies it (``at::mul_out`` with a wrapped scalar,
``Reducer::mark_variable_ready_dense``). At 3 ranks the two differ in the last bit of about a third of the
elements. With a hook registered DDP hands the hook the same undivided bucket in either mode, so
``allreduce_hook`` (``tensor.div_(world_size)``, SUM) is exactly the batched native, and a hook that
multiplies by ``1/world_size`` exactly the default one. A spec that names both natives gets the
``batched_grad_copy`` parity cases beside its default ones; a spec meant for the batched copy alone has every
case run with ``batched_grad_copy=True`` added to its config's options (its ``default`` cases in the
``batched_grad_copy`` config), so that each config is checked against the native its jobs run.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from conformance.spec import HookSpec

#: The config (:data:`conformance.apis.ddp.standalone.CONFIGS`) of DDP's batched-copy native.
BATCHED_CONFIG = "batched_grad_copy"
#: DDP's natives a spec may name (``HookSpec.native_modes``), its default first.
NATIVE_MODES = ("default", BATCHED_CONFIG)
#: Why a reduced-precision claim has no ``batched_grad_copy`` case: the flag changes only the averaging of DDP
#: with no hook, and that claim's reference is a hook (``fp16_compress_wrapper(allreduce_hook)``), whose bucket
#: DDP hands over the same either way.
NATIVE_MODE_CLAIM_NOTE = ("batched_grad_copy=True changes only DDP's own averaging with no hook; this claim's "
                          "reference is a hook, handed the same bucket in either mode")


def native_mode_unavailable() -> Optional[str]:
    """Why this torch's DDP has no ``batched_grad_copy`` argument (torch 2.13 has it), or ``None``."""
    from torch.nn.parallel import DistributedDataParallel

    if "batched_grad_copy" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        return (f"torch {torch.__version__}'s DistributedDataParallel has no batched_grad_copy argument (torch 2.13 "
                "added it), so its native averages one way only")
    return None


def native_mode_skip(spec: HookSpec) -> Optional[str]:
    """Why ``spec`` has no ``batched_grad_copy`` case that can run here, or ``None``: a reduced-precision claim
    (:data:`NATIVE_MODE_CLAIM_NOTE`), a torch without the argument (:func:`native_mode_unavailable`)."""
    if reduced_claim(spec):
        return NATIVE_MODE_CLAIM_NOTE
    if not spec.meant_for(BATCHED_CONFIG):
        return (f"the spec is meant for DDP's default native only; HookSpec(native_modes=('default', "
                f"'{BATCHED_CONFIG}')) checks it against DistributedDataParallel(batched_grad_copy=True) too")
    return native_mode_unavailable()


def reduced_claim(spec: HookSpec) -> bool:
    """Whether ``spec`` claims a reduce dtype other than its parameters': its reference is then a hook
    (``fp16_compress_wrapper(allreduce_hook)``), the same in either of DDP's natives."""
    return spec.reduce_dtype not in (None, spec.param_dtype or torch.float32)


def batched_only(spec: HookSpec) -> bool:
    """Whether ``spec`` is meant for DDP's batched copy alone (``HookSpec(native_modes=("batched_grad_copy",))``):
    then every case of it trains both models with ``batched_grad_copy=True`` beside its config's own options
    (:func:`config_of`, :func:`ddp_options`), its reference included."""
    return spec.meant_for(BATCHED_CONFIG) and not spec.meant_for("default")


def config_of(spec: HookSpec, config: str) -> str:
    """The config a case of ``spec`` planned in ``config`` runs in: ``batched_grad_copy`` in place of ``default``
    for a spec meant for the batched copy alone (:func:`batched_only`), ``config`` otherwise."""
    return BATCHED_CONFIG if config == "default" and batched_only(spec) else config


def ddp_options(config_options: Dict[str, Any], batched: bool) -> Dict[str, Any]:
    """The ``DistributedDataParallel`` keyword arguments of a case: its config's (``CONFIGS[config]``), with
    ``batched_grad_copy=True`` where the case's native is the batched copy (``batched``)."""
    return {**config_options, "batched_grad_copy": True} if batched else dict(config_options)


def divides(config: str, spec: HookSpec = None) -> bool:
    """Whether DDP's native in ``config`` (for ``spec``, where given) divides the bucket by the world size (the
    batched copy) rather than multiply each gradient by ``1/world_size``: the ``batched_grad_copy`` config, and
    every config but the compiled one of a spec meant for the batched copy alone."""
    return config == BATCHED_CONFIG or (spec is not None and config != "compiled_autograd" and batched_only(spec))


def batched_skip(spec: HookSpec, config: str) -> Optional[str]:
    """Why a case of ``spec`` in ``config`` cannot run here (``None``: it can): it trains DDP's batched copy
    (:func:`divides`) and this torch's DDP has no ``batched_grad_copy`` (:func:`native_mode_unavailable`)."""
    return native_mode_unavailable() if divides(config, spec) else None


def option_unavailable(options: Dict[str, Any], config: str) -> Optional[str]:
    """Why this torch's DDP cannot be built with ``options`` (config ``config``'s constructor arguments), or
    ``None``: an argument its ``DistributedDataParallel`` does not have (``skip_all_reduce_unused_params``, say)."""
    from torch.nn.parallel import DistributedDataParallel

    known = inspect.signature(DistributedDataParallel.__init__).parameters
    missing = [name for name in options if name not in known]
    if missing:
        return (f"torch {torch.__version__}'s DistributedDataParallel has no {', '.join(missing)} argument, which "
                f"config {config!r} sets")
    return None
