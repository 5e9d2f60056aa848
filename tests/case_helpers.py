"""The FSDP hook specs the tests of ``conformance.cases`` plan cases for (``tests/test_cases.py``,
``tests/test_cases_plans.py``): one per calling convention, as FSDP1 tells them apart by the hook's signature."""

from __future__ import annotations

from conformance.spec import HookSpec


def no_shard_hook(state, grad):
    """An FSDP1 hook of ``(state, grad)``: it serves NO_SHARD alone."""


def sharded_hook(state, grad, output):
    """An FSDP1 hook of ``(state, grad, output)``: it serves the sharded strategies alone."""


def any_strategy_hook(state, grad, output=None):
    """An FSDP1 hook whose ``output`` is optional: it serves every strategy."""


def make_spec(name, hook):
    """An FSDP1 ``HookSpec`` named ``name`` over ``hook``, its state the process group."""
    return HookSpec(name=name, api="fsdp", hook=hook, state=lambda pg: pg)


NO_SHARD_ONLY = make_spec("ns_only", no_shard_hook)
SHARDED_ONLY = make_spec("sh_only", sharded_hook)
EVERYWHERE = make_spec("every.where", any_strategy_hook)
SPECS = [NO_SHARD_ONLY, SHARDED_ONLY, EVERYWHERE]
