"""The plug-in contract: :class:`HookSpec`, one hook under test and what it claims.

A spec names a hook, the data-parallel API it plugs into, how to build its
state on each rank, and its claim about numerics. The suite checks the claim:

* ``reduce_dtype=None``: the hook reproduces the native full-precision
  averaging bit for bit (FSDP: ``_reduce_grad`` / ``_reduce_grad_no_shard``
  with no hook registered).
* ``reduce_dtype=X``: the hook reproduces FSDP's native
  ``MixedPrecision(reduce_dtype=X)`` bit for bit, and hands back gradients in
  the parameter dtype.
* ``param_dtype=P`` (besides either): every check trains in ``P``, the dtype the
  hook is meant for (FSDP1 ``MixedPrecision(param_dtype=P, reduce_dtype=X)``,
  FSDP2 ``MixedPrecisionPolicy(param_dtype=P, reduce_dtype=X)``, DDP the model
  in ``P``), and the hook must equal the native path trained the same way.

Specs are loaded by the controller and again inside every rank process, so a
spec must be importable by module path (``pkg.module:ATTR``).

Importing this module loads no API plan: the API registry
(:data:`conformance.apis.registry.HOOK_APIS`), which validates ``api`` and holds each API's rules (its
calling convention, whether it takes a state), is imported when the first spec is built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any, Callable, Optional, Tuple

import torch

from conformance.ulps import dtype_name
from conformance.signatures import SpecError

__all__ = ["HookSpec", "LossyContract", "Switches"]

#: Spec names become part of every test id, so they are kept to characters that
#: survive in pytest ids, ``-k`` expressions and JUnit XML unchanged.
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")

_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The parameter dtypes a spec may claim (``HookSpec.param_dtype``): the low-precision ones models train in.
PARAM_DTYPES = (torch.float16, torch.bfloat16)


def _hook_apis() -> Any:
    """The API registry, imported on first use: the plans load when a spec is built, not when
    ``conformance`` is imported."""
    from conformance.apis.registry import HOOK_APIS

    return HOOK_APIS


@dataclasses.dataclass(frozen=True)
class LossyContract:
    """What a lossy hook (PowerSGD, 8-bit quantization, ...) promises instead of exactness.

    A spec with ``lossy=LossyContract(...)`` (api ``ddp``, ``fsdp`` or ``fsdp2``) is
    not held to bitwise parity: its exact checks are replaced by the contract's
    (``conformance/ranks/checks/lossy.py``). The suite checks, always: no NaN/Inf
    appears where the exact mean had none, and the API's structural rules still
    hold (DDP: the future's shape, dtype and device, rank consistency; FSDP1: the
    registration rules, the hook's output in the parameter dtype, rank
    consistency under ``NO_SHARD``; FSDP2: ``allocate``'s buffers). And, where
    declared here:

    Attributes:
        rel_error_bound: per step and per parameter,
            ``||g_hook - g_exact||_2 / ||g_exact||_2 <= rel_error_bound``, where
            ``g_exact`` is the exact mean over ranks, computed in float64 (0/0
            counts as 0, x/0 as infinite). Checked over several training steps
            and configurations; the observed maximum is reported as a figure
            either way. ``None``: not claimed.
        deterministic: two fresh runs (new model, new hook state) from the same
            seed give bitwise-identical gradients at every step.
        loss_margin: after ``loss_steps`` SGD steps,
            ``|loss_hook - loss_exact| <= loss_margin * |loss_exact|``, the loss
            being the mean over ranks of each rank's loss and ``loss_exact`` that
            of the same model under the API with no hook, in full precision.
            ``None``: not claimed.
        loss_steps: training steps for the loss-margin check.

    Sharded gradients (FSDP1 sharded strategies, FSDP2) are compared whole,
    gathered over the ranks, so the bound is per parameter, not per shard.

    Raises:
        SpecError: a bound that is negative or not finite, or ``loss_steps < 1``.
    """

    rel_error_bound: Optional[float] = None
    deterministic: bool = True
    loss_margin: Optional[float] = None
    loss_steps: int = 10

    def __post_init__(self) -> None:
        for name in ("rel_error_bound", "loss_margin"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise SpecError(f"LossyContract {name}={value!r} must be a finite number >= 0, or None")
        if not isinstance(self.loss_steps, int) or self.loss_steps < 1:
            raise SpecError(f"LossyContract loss_steps={self.loss_steps!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class Switches:
    """Where a hook's code takes another path: the switches a hook author names, so that the suite reaches them
    together (``HookSpec(switches=Switches(steps=64, elements=2**19))``).

    Real hooks combine their switches (PowerSGD compresses after ``start_powerSGD_iter`` steps *and* only tensors
    past ``min_compression_rate``; a hierarchical all-reduce switches on the node layout *and* the message size).
    The suite's own cases reach each axis on its own; a spec that names its switches gets, at every depth, a
    combined case on each API it targets (the API's long run, on a buffer past the size, for steps past the
    count, in the node layout: :func:`conformance.apis.switch_plan`), and its verdict says what that reached.
    Name what the hook's code tests, read off its never-taken branches (``hook code: ... never taken:
    my_hooks.py:88``; docs/hooks.md "Which of your hook's code ran").

    Attributes:
        steps: the hook takes its other path after this many training steps (or calls per bucket, FSDP unit or
            input size: one a step in the suite's models); the case trains past it.
        elements: from buffers of this many elements (the buffer the API hands the hook: a DDP bucket, an
            FSDP1 flat gradient, an FSDP2 reduce-scatter input, a replica tensor).
        bytes: from buffers of this many bytes (in the dtype the hook is handed), where the hook tests bytes.
        nodes: across this many nodes (torchrun's ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ...); the case runs with
            the layout variables of that many nodes.

    Raises:
        SpecError: none given, or a value that is not a positive integer (``nodes`` at least 2).
    """

    steps: Optional[int] = None
    elements: Optional[int] = None
    bytes: Optional[int] = None
    nodes: Optional[int] = None

    def __post_init__(self) -> None:
        values = {"steps": self.steps, "elements": self.elements, "bytes": self.bytes, "nodes": self.nodes}
        if all(v is None for v in values.values()):
            raise SpecError("Switches() names no switch: give steps=, elements=, bytes= or nodes= (e.g. "
                            "Switches(steps=1000, elements=2**20) for PowerSGD's start_powerSGD_iter and a size)")
        for name, value in values.items():
            least = 2 if name == "nodes" else 1
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise SpecError(f"Switches {name}={value!r} must be an int >= {least}, or None")

    def elements_for(self, itemsize: int) -> Optional[int]:
        """The size switch in elements of ``itemsize`` bytes (the larger of :attr:`elements` and :attr:`bytes`
        so converted), or ``None``."""
        sizes = [n for n in (self.elements, -(-self.bytes // itemsize) if self.bytes is not None else None)
                 if n is not None]
        return max(sizes) if sizes else None


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """One gradient communication hook under test.

    Args:
        name: unique name; appears in every test id of this hook. Letters,
            digits, ``_`` and ``.``; must not start with a digit.
        api: ``"fsdp"``: installed with
            ``FullyShardedDataParallel.register_comm_hook(state, hook)``.
        hook: the hook callable. For ``api="fsdp"``: ``hook(state, grad)`` for
            ``NO_SHARD`` (``grad``: the flat, unsharded gradient of one FSDP
            unit, 1-D, reduced in place) and ``hook(state, grad, output)`` for
            ``FULL_SHARD``/``SHARD_GRAD_OP`` (``grad``: padded flat unsharded
            gradient, 1-D, ``world_size * shard_numel`` elements; ``output``:
            the 1-D shard the hook must fill). A callable object works too.
        state: called on each rank as ``state(process_group)``; returns the
            hook's state object (for example
            ``torch.distributed.algorithms._comm_hooks.default_hooks.DefaultState``).
            A fresh state is built for every model the suite trains.
        reduce_dtype: the claim. ``None``: full-precision default averaging (under a ``param_dtype`` claim:
            the API's own averaging in that dtype, as FSDP defaults its reduce dtype to the parameter dtype).
            ``torch.float16``/``torch.bfloat16``/...: equals FSDP's
            ``MixedPrecision(reduce_dtype=reduce_dtype)`` with no hook.
        strategies: sharding strategies to check (names of
            ``ShardingStrategy`` members). ``None`` derives them from the
            hook's signature: a hook that accepts ``(state, grad)`` runs under
            ``NO_SHARD``, one that accepts ``(state, grad, output)`` under the
            sharded strategies.
        description: one line shown in the report header.
        lossy: what a lossy hook promises instead of exactness (api ``ddp``,
            ``fsdp`` and ``fsdp2``; an ``fsdp2_all_reduce`` hook cannot declare
            one and raises :class:`SpecError`).
        requires: modules the hook imports when it runs (PowerSGD's state
            imports ``numpy``). Where one is not installed, the hook's cases are
            skipped with a reason that names it: the suite never reports a
            missing package as the hook failing.
        compiled_ddp: api ``ddp`` only (``HookApi.compiled_convention``): the hook also takes compiled DDP's
            calling convention. Under compiled autograd
            (``torch._dynamo.config.optimize_ddp = "python_reducer"``,
            ``DistributedDataParallel._register_accum_grad_hook``) DDP calls
            ``hook(state, (grad, param))`` once per parameter and ignores the
            return value: the hook must reduce ``grad`` (``param.grad``) in
            place. Only such hooks get ``--with-compiled-ddp`` cases; a
            ``GradBucket`` hook (PyTorch's own included) is skipped there with
            the reason, whatever its annotations.
        param_dtype: the parameter dtype the hook is meant for, or ``None`` (the models' own, float32). With
            ``torch.bfloat16`` (or ``torch.float16``) every check of the spec trains in it, reference and
            hooked model alike: FSDP1 under ``MixedPrecision(param_dtype=P, reduce_dtype=reduce_dtype)``,
            FSDP2 under ``MixedPrecisionPolicy(param_dtype=P, reduce_dtype=reduce_dtype)`` (the sharded
            parameters and their gradients stay float32 in both; the hook sees the reduce dtype, or ``P``
            where ``reduce_dtype`` is ``None``, as FSDP defaults the reduction to the parameter dtype), DDP
            with the model in ``P`` (pure low-precision training: DDP reduces in the gradients' dtype). A
            bfloat16-on-the-wire comm that is exact there, and lossy on float32 parameters, claims it so.
            Its case ids carry ``params_<dtype>``; its verdict line says ``params <dtype>``.
        switches: where the hook's code takes another path (:class:`Switches`: after how many steps, from how many
            elements or bytes, across how many nodes), or ``None``: with them, every depth adds the cases where
            they all hold at once (exact claims).
        native_modes: which of its API's natives the hook is meant to equal (``HookApi.native_modes``), or
            ``None``: the API's default one. For ``api="ddp"``: ``"default"`` (DDP as constructed by default,
            which multiplies each gradient by ``1/world_size`` as it fills the bucket) and ``"batched_grad_copy"``
            (``DistributedDataParallel(..., batched_grad_copy=True)``, torch 2.13+, which divides the flat
            bucket by the world size; PyTorch's ``allreduce_hook`` equals it). The ``batched_grad_copy`` parity
            cases run only for a spec that names it; a spec that does not name ``"default"`` has its cases
            against DDP's default native skipped with the reason. For ``api="fsdp2"``: ``"default"`` and
            ``"sum_no_divide"`` (``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)``:
            FSDP2 hands the comm ``SUM`` and divides nothing); a spec meant for ``sum_no_divide`` alone has its
            default cases run in that config instead; ``"accumulation"`` (``set_requires_gradient_sync(False)``
            on every micro-batch but the last): without ``"default"``, only ``test_fsdp2_accumulation`` runs.
        sample_checks: the built-in hooks' extra claims (a parameter dtype) in the default run: only these
            checks (their names in reports, e.g. ``("parity", "accumulation")``) run, each at the first world
            size of at least 2 ranks (the main one on a CPU machine) on one node, under the first variant and
            model of its plan; ``None`` (a spec of yours): every check of its API.

    Raises:
        SpecError: on construction, for a bad name, an unknown api, a hook
            that is not callable or whose signature fits no strategy, a state
            factory that is not callable, an unsupported reduce dtype or
            parameter dtype, an unknown strategy, ``compiled_ddp`` set on an api without a
            compiled calling convention (``HookApi.compiled_convention``), or ``switches`` that is not a
            :class:`Switches`, or ``native_modes`` that names no native of its api.
    """

    name: str
    api: str
    hook: Any
    state: Optional[Callable[[Any], Any]] = None
    reduce_dtype: Optional[torch.dtype] = None
    strategies: Optional[Tuple[str, ...]] = None
    description: str = ""
    lossy: Optional[LossyContract] = None
    requires: Tuple[str, ...] = ()
    compiled_ddp: bool = False
    param_dtype: Optional[torch.dtype] = None
    sample_checks: Optional[Tuple[str, ...]] = None
    switches: Optional[Switches] = None
    native_modes: Optional[Tuple[str, ...]] = None

    def __post_init__(self) -> None:
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        if not all(isinstance(m, str) and m for m in requires):
            raise SpecError(f"HookSpec {getattr(self, 'name', '?')!r}: requires={self.requires!r} must be module "
                            "names, e.g. requires=('numpy',)")
        object.__setattr__(self, "requires", requires)
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise SpecError(
                f"HookSpec name {self.name!r} is not usable in test ids: use letters, "
                "digits, '_' and '.', not starting with a digit (e.g. 'my_fp16_hook')"
            )
        hook_apis = _hook_apis()
        api = hook_apis.get(self.api)
        if api is None:
            raise SpecError(
                f"HookSpec {self.name!r}: unknown api {self.api!r}; expected one of {', '.join(hook_apis)}"
            )
        if not callable(self.hook):
            raise SpecError(
                f"HookSpec {self.name!r}: hook {self.hook!r} is not callable; pass the hook "
                "function (or an object with __call__), not the result of calling it"
            )
        if api.stateful and not callable(self.state):
            raise SpecError(
                f"HookSpec {self.name!r}: state {self.state!r} is not callable; pass a factory "
                "called as state(process_group), e.g. DefaultState"
            )
        if self.lossy is not None and not isinstance(self.lossy, LossyContract):
            raise SpecError(
                f"HookSpec {self.name!r}: lossy={self.lossy!r} must be a LossyContract, e.g. "
                "lossy=LossyContract(rel_error_bound=0.1, loss_margin=0.05)"
            )
        if not isinstance(self.compiled_ddp, bool) or (self.compiled_ddp and not api.compiled_convention):
            with_it = ", ".join(repr(name) for name, a in hook_apis.items() if a.compiled_convention)
            raise SpecError(
                f"HookSpec {self.name!r}: compiled_ddp={self.compiled_ddp!r} says a DDP hook also takes compiled "
                f"DDP's hook(state, (grad, param)); it must be True or False, and True only with api={with_it} "
                f"(this spec's api is {self.api!r})"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in _REDUCE_DTYPES:
            raise SpecError(
                f"HookSpec {self.name!r}: reduce_dtype {self.reduce_dtype!r} is not a floating "
                "dtype FSDP can reduce in; use None, torch.float16, torch.bfloat16, torch.float32 or torch.float64"
            )
        if self.param_dtype is not None and self.param_dtype not in PARAM_DTYPES:
            raise SpecError(
                f"HookSpec {self.name!r}: param_dtype {self.param_dtype!r} is not a dtype the suite trains in; use "
                "None (the models' float32), torch.bfloat16 or torch.float16"
            )
        if self.switches is not None and not isinstance(self.switches, Switches):
            raise SpecError(
                f"HookSpec {self.name!r}: switches={self.switches!r} must be a Switches, e.g. "
                "switches=Switches(steps=1000, elements=2**20)"
            )
        if self.native_modes is not None:
            modes = (self.native_modes,) if isinstance(self.native_modes, str) else tuple(self.native_modes)
            unknown = [m for m in modes if m not in api.native_modes]
            if not modes or unknown:
                known = ", ".join(repr(m) for m in api.native_modes) or f"none: api {self.api!r} has one native"
                raise SpecError(f"HookSpec {self.name!r}: native_modes={self.native_modes!r} names no native of api "
                                f"{self.api!r}; its natives: {known}")
            object.__setattr__(self, "native_modes", modes)
        if self.sample_checks is not None:
            object.__setattr__(self, "sample_checks", tuple(self.sample_checks))
        object.__setattr__(self, "strategies", api.validate(self))

    def natives(self) -> Tuple[str, ...]:
        """The natives of its API the hook is held to: :attr:`native_modes`, else the API's default
        (``("default",)``, also for an API with one native)."""
        if self.native_modes is not None:
            return tuple(self.native_modes)
        api = _hook_apis().get(self.api)
        return tuple(api.native_modes[:1]) if api is not None and api.native_modes else ("default",)

    def meant_for(self, mode: str) -> bool:
        """Whether the hook is meant to equal its API's native ``mode`` (:attr:`native_modes`; ``None``: only
        the API's first, its default)."""
        modes = self.native_modes
        if modes is None:
            api = _hook_apis().get(self.api)
            modes = api.native_modes[:1] if api is not None else ()
        return mode in modes

    def missing_requirements(self) -> Tuple[str, ...]:
        """The modules of :attr:`requires` that cannot be imported here."""
        missing = []
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                missing.append(module)
        return tuple(missing)

    @property
    def reduce_dtype_name(self) -> str:
        """``"full"`` for the full-precision claim, else the dtype's short name."""
        if self.reduce_dtype is None:
            return "full"
        return dtype_name(self.reduce_dtype)

    @property
    def param_dtype_name(self) -> Optional[str]:
        """The claimed parameter dtype's short name (``"bfloat16"``), or ``None`` where the spec claims none."""
        return None if self.param_dtype is None else dtype_name(self.param_dtype)
