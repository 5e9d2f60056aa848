"""FSDP1's native reduction of one buffer, for the diagnosis (an FSDP extra).

``_reduce_grad`` / ``_reduce_grad_no_shard`` in ``torch/distributed/fsdp/_runtime_utils.py``:
cast to the reduce dtype, divide by the pre-divide factor, SUM (an all-reduce,
or a reduce-scatter when sharded), divide by the post-divide factor, cast back
(``_div_if_needed`` with ``_get_gradient_predivide_factor``).

Besides the shared causes, a hook may pre-divide and never post-divide the result FSDP reads: a sharded hook that
reduce-scatters into ``output`` and then post-divides ``grad`` (:meth:`FsdpArithmetic.changes`), in the collective's
order or over a two-level reduction (within each node, then across nodes) on a job across nodes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Tuple

from conformance.ranks.arithmetic import Arithmetic
from conformance.ranks.reduction import ALL_REDUCE, NODES, REDUCE_SCATTER, Reduction, Scale
from conformance.ulps import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from conformance.ranks.hook_call import HookCall


class FsdpArithmetic(Arithmetic):
    """FSDP1's pre-divide, SUM, post-divide (see the module docstring)."""

    @property
    def factors(self) -> Tuple[float, float]:
        """FSDP's ``(predivide, postdivide)``: ``_get_gradient_predivide_factor`` and its complement."""
        factor = 1
        while self.world_size % factor == 0 and self.world_size / factor > factor:
            factor *= 2
        return float(factor), self.world_size / factor

    @property
    def divides_before_sum(self) -> bool:  # type: ignore[override]
        """Where the pre-divide factor is the world size (1 or 2 ranks), dividing first is native's order."""
        return self.factors[0] == self.world_size

    def reduction(self, call: HookCall) -> Reduction:
        """Cast, ``/ predivide``, SUM (a reduce-scatter when sharded), ``/ postdivide`` (a factor of 1 is skipped)."""
        pre, post = self.factors
        return Reduction(pre=(Scale(pre),) if pre > 1 else (), post=(Scale(post),) if post > 1 else (),
                         dtype=self.reduce_dtype, collective=REDUCE_SCATTER if call.sharded else ALL_REDUCE)

    def changes(self, call: HookCall) -> List[Reduction]:
        """The shared causes, then FSDP's pre-divide without its post-divide, in the collective's order (where both
        factors exceed 1: 3 ranks and more)."""
        out = super().changes(call)
        native = out[0]
        return out + ([dataclasses.replace(native, post=())] if native.pre and native.post else [])

    def two_level_changes(self, call: HookCall, native: Reduction) -> List[Reduction]:
        """The shared two-level causes, after FSDP's pre-divide without its post-divide summed in two levels: a
        hierarchical hook that post-divides ``grad`` after copying its shard into ``output``."""
        shared = super().two_level_changes(call, native)
        if not shared or not (native.pre and native.post):
            return shared
        return [dataclasses.replace(native, order=NODES, node_size=shared[0].node_size, post=())] + shared

    def describe(self) -> str:
        pre, post = self.factors
        return f"FSDP pre-divides by {pre:g} and post-divides by {post:g}"

    group_arg = "group=state.process_group"

    def how_to_average(self) -> str:
        pre, post = self.factors
        steps = [f"divide by state.gradient_predivide_factor ({pre:g}) before the SUM"] if pre > 1 else []
        if post > 1:
            steps.append(f"by state.gradient_postdivide_factor ({post:g}) after it" if steps else
                         f"divide by state.gradient_postdivide_factor ({post:g}) after the SUM")
        how = " and ".join(steps) or "reduce with SUM (one rank: no division)"
        if self.reduce_dtype is not None:
            how = f"cast to {dtype_name(self.reduce_dtype)} first, then {how}, and cast back"
        return f"{how}, as FSDP's _reduce_grad does"

    def where_result_goes(self, call: HookCall) -> str:
        if call.sharded:
            return "write the reduced shard into output (FSDP reads output, not grad, under a sharded strategy)"
        return "reduce grad in place (FSDP reads the gradient it passed the hook)"
