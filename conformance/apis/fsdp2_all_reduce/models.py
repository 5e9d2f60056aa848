"""The all-reduce hook's rank side: :class:`AllReduceHookModels`.

The hook is installed with ``FSDPModule.set_all_reduce_hook`` on every FSDP
module, in a config of the API's setup object
(:data:`~conformance.apis.fsdp2_all_reduce.standalone.SETUP`): native HSDP on a
2-D (replicate x shard) mesh, or ``replicate`` on FSDP2, through a
:class:`~conformance.apis.fsdp2_common.recorders.HookRecorder`; the reference is
the same model without it. What every FSDP2 API's models share is
:class:`~conformance.apis.fsdp2_common.models.Fsdp2Models`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Tuple

from conformance.apis.fsdp2_all_reduce.arithmetic import AllReduceHookArithmetic
from conformance.apis.fsdp2_all_reduce.standalone import SETUP
from conformance.apis.fsdp2_common.models import Fsdp2Models
from conformance.apis.fsdp2_common.recorders import HookRecorder
from conformance.apis.fsdp2_common.registration import ALL_REDUCE_HOOK
from conformance.apis.fsdp2_common.registration_rules import registration_check
from conformance.ranks.checks.models import Recorder

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conformance.ranks.checks.groups import CheckContext
    from conformance.spec import HookSpec

#: ``fsdp2_all_reduce.registration``: the registration rules of ``set_all_reduce_hook`` with the spec's hook,
#: under native HSDP (``config="hsdp"``: the 2-D replicate x shard mesh of the pool).
registration = registration_check(SETUP, ALL_REDUCE_HOOK)


class AllReduceHookModels(Fsdp2Models):
    """An all-reduce hook's models, where FSDP2 calls the hook after its own all-reduce: native HSDP on a 2-D
    (replicate x shard) mesh of the pool (``config="hsdp"``), or ``replicate`` on FSDP2 over the pool
    (``"replicate"``, AVG; ``"replicate_sum"``, ``set_gradient_divide_factor(1.0)``: a SUM, torchtitan's
    default), where the hook gets every module's whole gradient. Accumulation turns FSDP2's all-reduce off
    (``set_requires_all_reduce(False)``): the hook runs on the last micro-batch only.

    Raises:
        ValueError: ``config`` is not one of :data:`~conformance.apis.fsdp2_all_reduce.plan.ALL_REDUCE_CONFIGS`.
    """

    setup = SETUP

    def __init__(self, ctx: CheckContext, spec: HookSpec, *, model: str, config: str = "hsdp", micro_steps: int = 1):
        super().__init__(ctx, spec, model=model, config=config, micro_steps=micro_steps)
        ws = self.ctx.world_size
        #: ``(replicate, shard)`` of the mesh; ``(world size, 1)`` under ``replicate``.
        self.mesh_shape: Tuple[int, int] = tuple(self.shape) if self.shape is not None else (ws, 1)
        divisors = (self.mesh_shape[0], self.mesh_shape[1], ws) if self.shape is not None else (ws,)
        self.arithmetic = AllReduceHookArithmetic(ws, None, divisors=divisors,
                                                  native_name="replicate" if self.shape is None else "native HSDP")

    def recorder(self, hook: Callable[[torch.Tensor], object]) -> Recorder:
        return HookRecorder(hook, self.ctx.rank, self.mesh_shape)
