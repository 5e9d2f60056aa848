"""DDP's future contract, checked with the hook under test: the rank check ``ddp.future_contract``.

``DistributedDataParallel.register_comm_hook(state, hook)`` must accept the
bare hook (DDP inspects its signature and name), and every future the hook
returns must hold one tensor with the bucket buffer's shape, dtype and device
(:class:`~conformance.apis.ddp.recorder.DDPHookRecorder` records each). It is
checked on every training config at every world size (the API's own check,
:attr:`conformance.apis.HookApi.checks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from conformance.apis.ddp.models import DdpModels, build_ddp
from conformance.protocol import Finding, FindingKind
from conformance.ranks.checks.common import hooked_step, sgd, train_step

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec


def _bare_registration(ctx: CheckContext, spec: HookSpec) -> List[Finding]:
    """DDP must accept the hook itself: ``register_comm_hook`` inspects its signature and name."""
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
        return [Finding(ctx.rank, f"DistributedDataParallel.register_comm_hook rejects the hook: {text}; {hint}",
                        kind=FindingKind.CONTRACT)]
    return []


def future_contract(ctx: CheckContext, spec: HookSpec, *, config: str, model: str, steps: int = 4,
                    lr: float = 0.01) -> List[Finding]:
    """DDP accepts the bare hook; each future holds one tensor like the bucket buffer; every step calls it.

    In the ``small_buckets`` and ``bucket_per_param`` configs the model must span
    several buckets from the second step on (else the config tests nothing and
    the check raises).
    """
    ctx.phase("registering the bare hook on a DDP model")
    findings = _bare_registration(ctx, spec)
    models = DdpModels(ctx, spec, model=model, config=config)
    hooked = models.build(hooked=True)
    recorder = hooked.recorder
    optim = sgd(hooked.model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        broken = hooked_step(recorder, train_step, ctx, "hooked", step, hooked.model, optim, models.inputs,
                             models.loss_fn)
        if broken:
            return findings + broken
        findings += recorder.never_called(step)
        if ctx.any_rank(bool(findings) or bool(recorder.violations)):
            return findings + recorder.violations
        optim.step()
    if config in ("small_buckets", "bucket_per_param"):
        buckets = max((len({i for s, i in recorder.calls if s == step}) for step in range(steps)), default=0)
        if buckets < 2:
            raise RuntimeError(f"the {config} config gave {buckets} bucket(s) for model {model!r}; "
                               "the suite needs a smaller bucket cap or a larger model")
    return findings

