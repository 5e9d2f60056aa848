"""Conformance of FSDP2 (``fully_shard``) custom comms and all-reduce hooks.

``api="fsdp2"``: a ``ReduceScatter`` comm installed with
``FSDPModule.set_custom_reduce_scatter`` on every FSDP module must give
gradients (local shards and full tensors) and parameters bitwise equal to
native ``fully_shard`` under the same ``MixedPrecisionPolicy(reduce_dtype=...)``,
under each config of :data:`conformance.checks.fsdp2.CONFIGS`.

``api="fsdp2_all_reduce"``: a hook installed with ``FSDPModule.set_all_reduce_hook``
under native HSDP (2 x world_size/2 mesh) must leave every gradient bitwise as
native HSDP without it.

HSDP needs 4 ranks: it runs at the smallest world size of the run that fits a
2-D mesh (4+ GPUs: the main pool), else on an extra 4-rank pool (the default
CPU run, 2 and 3 ranks); see :data:`START_HSDP_POOL`.

Case ids: ``{hook}-{config}-{model}-ws{N}``; ``-k fsdp2`` selects this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from conformance.checks.fsdp2 import CONFIG_APIS, GLOO_PREMUL_SUM, HSDP_REPLICATE, missing_api, uses_premul_sum
from conformance.cases import CaseParams
from conformance.pytest_plugin import state_of, tag

pytestmark = pytest.mark.conformance(api="fsdp2")

#: ``(config, model)`` pairs per world-size role and claim. The full-precision claim runs
#: every reference model at the main world size; a reduced-precision claim (its comm sees
#: the same ops on bfloat16/float16 buffers) runs fewer. The divide-factor and forced-SUM
#: configs run on one model: they change the op FSDP2 passes, not the model.
FACTOR_CONFIGS = ("divide_factor", "force_sum", "divide_factor_force_sum")
PLAN: Dict[Tuple[str, str], Tuple[Tuple[str, str], ...]] = {
    ("main", "full"): tuple(("default", m) for m in ("net_wrapped", "nested_wrapped", "always_wrap_nested",
                                                     "gradient_probe", "mixture_of_experts"))
    + tuple((c, "nested_wrapped") for c in FACTOR_CONFIGS),
    ("extra", "full"): (("default", "nested_wrapped"), ("default", "gradient_probe"),
                        ("divide_factor", "nested_wrapped"), ("divide_factor_force_sum", "nested_wrapped")),
    ("main", "low"): (("default", "nested_wrapped"), ("divide_factor", "nested_wrapped"),
                      ("divide_factor_force_sum", "nested_wrapped")),
    ("extra", "low"): (("default", "nested_wrapped"),),
    ("hsdp", "full"): (("hsdp", "nested_wrapped"),),
    ("hsdp", "low"): (("hsdp", "nested_wrapped"),),
}
#: Models an all-reduce hook runs under native HSDP.
ALL_REDUCE_MODELS = ("nested_wrapped",)
#: The smallest HSDP world size: a HSDP_REPLICATE x 2 (replicate x shard) mesh.
HSDP_WORLD_SIZE = 2 * HSDP_REPLICATE
#: Whether a run none of whose world sizes fits HSDP (the default CPU run: 2 and 3) starts an
#: extra HSDP_WORLD_SIZE-rank pool for the HSDP cases (gloo on CPU runs HSDP). Measured on the
#: project's 2-core machine: about +6 s (under load up to +13 s) for the pool's start-up and
#: first FSDP2 use plus its cases. ``False`` skips HSDP in such runs, saying how to get it
#: (``--extra-world-size 4``). Runs on 4+ GPUs use their main pool either way.
START_HSDP_POOL = True


def _specs(config: pytest.Config, api: str) -> list:
    return [item.spec for item in state_of(config).specs if item.spec.api == api]


def _known_models() -> set:
    from conformance.models import MODELS

    return set(MODELS)


def hsdp_world_size(sizes: List[int]) -> int:
    """The HSDP cases' world size: the smallest of the run's that fits a 2-D mesh, else HSDP_WORLD_SIZE."""
    fits = [ws for ws in sizes if ws >= HSDP_WORLD_SIZE and ws % HSDP_REPLICATE == 0]
    return min(fits) if fits else HSDP_WORLD_SIZE


def hsdp_unavailable(sizes: List[int]) -> Optional[str]:
    """Why this run leaves HSDP out (``None``: it runs), see :data:`START_HSDP_POOL`."""
    if START_HSDP_POOL or hsdp_world_size(sizes) in sizes:
        return None
    return (f"HSDP needs a 2-D (replicate x shard) mesh of at least {HSDP_WORLD_SIZE} ranks and this run's world "
            f"sizes are {' and '.join(map(str, sizes))}; gloo on CPU does run HSDP, but the default run leaves "
            f"the extra {HSDP_WORLD_SIZE}-rank pool out to stay fast: add --extra-world-size {HSDP_WORLD_SIZE} "
            "to run these cases")


def parity_cases(specs: List[Any], role_of: Callable[[int], str], sizes: List[int]) -> List[CaseParams]:
    """The comm cases of a run: per spec, :data:`PLAN` at each world size, then HSDP.

    ``role_of(world_size)`` is ``"main"`` or ``"extra"`` (:meth:`Settings.role`).
    """
    known = _known_models()
    out = []
    for spec in specs:
        claim = "full" if spec.reduce_dtype is None else "low"
        roles = [(role_of(ws), ws) for ws in sizes] + [("hsdp", hsdp_world_size(sizes))]
        for role, ws in roles:
            out.extend(CaseParams(spec.name, config, ws, model=model, api=spec.api) for config, model in PLAN[(role, claim)])
    return [c for c in out if c.model in known]


def all_reduce_cases(specs: List[Any], sizes: List[int]) -> List[CaseParams]:
    ws = hsdp_world_size(sizes)
    return [CaseParams(spec.name, "hsdp", ws, model=model, api=spec.api) for spec in specs for model in ALL_REDUCE_MODELS]


def skip_reason(case: CaseParams, spec: Any, settings: Any, api: str) -> Optional[str]:
    """Why ``case`` cannot run here (``None``: it runs)."""
    why = settings.world_size_unavailable(case.world_size)
    if why is not None:
        return why
    if case.variant == "hsdp":
        why = hsdp_unavailable(list(settings.world_sizes))
        if why is not None:
            return why
    if case.world_size < 2:
        return "FSDP2 calls no reduce-scatter over a single rank (it copies the gradient), so there is nothing to check"
    needed = ("set_all_reduce_hook",) if api == "fsdp2_all_reduce" else (
        ("set_custom_reduce_scatter",) + CONFIG_APIS[case.variant])
    why = missing_api(needed)
    if why is not None:
        return why
    if settings.backend == "gloo" and uses_premul_sum(case.variant, spec.reduce_dtype):
        return GLOO_PREMUL_SUM
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    state = state_of(metafunc.config)
    s = state.settings
    name = metafunc.function.__name__
    if name == "test_fsdp2_parity":
        api = "fsdp2"
        specs = _specs(metafunc.config, api)
        cases = parity_cases(specs, s.role, list(s.world_sizes))
    elif name == "test_fsdp2_all_reduce_hook":
        api = "fsdp2_all_reduce"
        specs = _specs(metafunc.config, api)
        cases = all_reduce_cases(specs, list(s.world_sizes))
    else:
        return
    by_name = {spec.name: spec for spec in specs}
    params = []
    for case in cases:
        why = skip_reason(case, by_name[case.hook], s, api)
        if why is None:
            params.append(pytest.param(case, id=case.id))
        else:  # no world size: the session does not start a pool for a case that cannot run
            params.append(pytest.param(dataclasses.replace(case, world_size=None), id=case.id,
                                       marks=[pytest.mark.skip(reason=why)]))
    metafunc.parametrize("case", params)


def test_fsdp2_parity(conform, request, case):
    """A custom reduce-scatter comm: local/full gradients and parameters bitwise equal to native fully_shard."""
    tag(request, case, "fsdp2_parity")
    conform.run(request.node.name, check="fsdp2.parity", hook=case.hook, world_size=case.world_size,
                params={"config": case.variant, "model": case.model}, describe=case.describe("fsdp2_parity"))


def test_fsdp2_all_reduce_hook(conform, request, case):
    """An all-reduce hook under native HSDP: gradients and parameters bitwise equal to HSDP without it."""
    tag(request, case, "fsdp2_all_reduce_hook")
    conform.run(request.node.name, check="fsdp2.all_reduce_parity", hook=case.hook, world_size=case.world_size,
                params={"model": case.model}, describe=case.describe("fsdp2_all_reduce_hook"))
