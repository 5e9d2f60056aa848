"""Valid and invalid hook targets for ``tests/test_spec_loading.py``.

Nothing here is ever called: the tests only load these objects as targets.
"""

from __future__ import annotations

from conformance.spec import HookSpec


def two_arg_hook(state, grad):
    """A NO_SHARD-shaped hook."""


def three_arg_hook(state, grad, output):
    """A sharded-shaped hook."""


def make_state(process_group):
    return process_group


SPEC = HookSpec(name="data_two", api="fsdp", hook=two_arg_hook, state=make_state)
SPECS = [
    HookSpec(name="data_three", api="fsdp", hook=three_arg_hook, state=make_state),
    HookSpec(name="data_other_two", api="fsdp", hook=two_arg_hook, state=make_state),
]
SPEC_TUPLE = (SPEC,)

#: Not specs: a bare hook, a list with a stray string, an empty list, a number.
NOT_A_SPEC = two_arg_hook
MIXED = [SPEC, "data_three"]
EMPTY = []
NUMBER = 3
