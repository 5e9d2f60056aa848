"""The long run's pieces that need no ranks: when the ranks check in, and the objective that keeps thousands of
steps meaningful (the end-to-end behaviour is the reach zoo's meta-run, ``tests/test_meta_reach.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from conformance.apis import LONG_RUN_STEPS
from conformance.models import get_model
from conformance.ranks.checks.long_run import CHECK_IN_EVERY, check_in
from conformance.shared.standalone_inputs import regression_inputs, regression_loss


def test_the_ranks_check_in_often_at_first_then_every_so_many_steps_and_at_the_end():
    steps = 2000
    at = [s for s in range(steps) if check_in(s, steps)]
    assert at[:7] == [0, 1, 3, 7, 15, 31, 63]
    assert all(b - a == CHECK_IN_EVERY for a, b in zip(at[6:-1], at[7:-1]))
    assert at[-1] == steps - 1
    assert len(at) < 40  # a dozen all-reduces over thousands of steps, not one a step
    assert [s for s in range(5) if check_in(s, 5)] == [0, 1, 3, 4]


def test_inputs_change_every_step_and_differ_across_ranks_and_micro_batches():
    model = get_model("net_flat")
    cpu = torch.device("cpu")
    a = regression_inputs(model, 0, 2, 0, 2, cpu)
    seeds = {x.seed for step in range(3) for rank in range(2) for x in regression_inputs(model, rank, 2, step, 2, cpu)}
    assert len(seeds) == 3 * 2 * 2
    assert not torch.equal(a[0][0], regression_inputs(model, 0, 2, 1, 2, cpu)[0][0])
    again = regression_inputs(model, 0, 2, 0, 2, cpu)
    assert torch.equal(a[1][0], again[1][0]) and a[1].seed == again[1].seed  # deterministic: the replay's


@pytest.mark.parametrize("name", ["net_flat", "nested_wrapped"])
def test_the_regression_keeps_gradients_finite_and_alive_for_the_nightly_horizon(name):
    """What made the long run necessary to redesign: on its own ``output.sum()`` loss the model overflows
    within ten steps, after which NaN equals NaN and nothing is compared. The regression keeps every gradient
    finite, and not vanishing, over the nightly horizon (SGD as the checks train it)."""
    cls = get_model(name)
    cpu = torch.device("cpu")
    model = cls.build(group=None, device=cpu, fsdp_kwargs=None)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
    steps = LONG_RUN_STEPS["nightly"]["steps"]
    smallest = math.inf
    for step in range(steps):
        optim.zero_grad(set_to_none=True)
        (micro,) = regression_inputs(cls, 0, 2, step, 1, cpu)
        regression_loss(micro, model(*micro)).backward()
        norms = [float(p.grad.norm()) for p in model.parameters()]
        assert all(math.isfinite(n) for n in norms), f"step {step}: {norms}"
        smallest = min(smallest, max(norms))
        optim.step()
    assert smallest > 1e-4
    own = cls.build(group=None, device=cpu, fsdp_kwargs=None)
    own_optim = torch.optim.SGD(own.parameters(), lr=0.01, momentum=0.9, foreach=False)
    x = cls.make_input(0, 2, cpu)
    for _ in range(20):
        own_optim.zero_grad(set_to_none=True)
        cls.loss(x, own(*x)).backward()
        own_optim.step()
    assert not all(torch.isfinite(p).all() for p in own.parameters())  # the reason for the regression
