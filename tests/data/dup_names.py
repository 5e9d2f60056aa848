"""A hook module that offers two specs under one name (a usage error)."""

from __future__ import annotations

from conformance.spec import HookSpec


def hook(state, grad):
    """Never called."""


SPECS = [
    HookSpec(name="twin", api="fsdp", hook=hook, state=lambda pg: pg),
    HookSpec(name="twin", api="fsdp", hook=hook, state=lambda pg: pg, description="the other one"),
]
