"""conformance.ranks.process_state: each kind of process-global change is named, and nothing else is."""

from __future__ import annotations

import io
import sys

import pytest
import torch
import torch.distributed as dist

from conformance.ranks import process_state


def test_nothing_changed_names_nothing():
    before = process_state.take()
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()  # ordinary work changes no global state
    assert process_state.changes(before, process_state.take()) == []


@pytest.mark.parametrize("change, expected", [
    (lambda mp: torch.set_default_dtype(torch.float64), "torch.get_default_dtype() == torch.float64 (it was torch.float32)"),
    (lambda mp: torch.set_grad_enabled(False), "torch.is_grad_enabled() == False (it was True)"),
    (lambda mp: torch.set_num_threads(torch.get_num_threads() + 1), "torch.get_num_threads() =="),
    (lambda mp: torch.use_deterministic_algorithms(True), "torch.are_deterministic_algorithms_enabled() == True"),
    (lambda mp: torch.set_float32_matmul_precision("medium"), "torch.get_float32_matmul_precision() == 'medium'"),
])
def test_a_torch_mode_left_changed_is_named_with_both_values(change, expected):
    saved = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
             torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
    before = process_state.take()
    try:
        change(None)
        found = process_state.changes(before, process_state.take())
    finally:
        torch.set_default_dtype(saved[0])
        torch.set_grad_enabled(saved[1])
        torch.set_num_threads(saved[2])
        torch.use_deterministic_algorithms(saved[3])
        torch.set_float32_matmul_precision(saved[4])
    assert any(expected in phrase for phrase in found), found
    assert process_state.changes(before, process_state.take()) == []


def test_a_global_module_hook_left_registered_is_named_until_removed():
    before = process_state.take()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        found = process_state.changes(before, process_state.take())
    finally:
        handle.remove()
    assert found == ["1 global module hook(s) registered with torch.nn.modules.module.register_module_forward_hook "
                     "still in place (they run on every model of the process); remove them (handle.remove())"]
    assert process_state.changes(before, process_state.take()) == []


def test_a_monkeypatched_distributed_function_is_named_with_where_the_replacement_was_defined(monkeypatch):
    before = process_state.take()

    def patched_reduce_scatter_tensor(*args, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(dist, "reduce_scatter_tensor", patched_reduce_scatter_tensor)
    found = process_state.changes(before, process_state.take())
    assert len(found) == 1 and found[0].startswith(
        "torch.distributed.reduce_scatter_tensor replaced by patched_reduce_scatter_tensor (")
    assert __file__ in found[0]


def test_replaced_or_closed_stdio_is_named(monkeypatch):
    before = process_state.take()
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert any(p.startswith("sys.stdout replaced by") for p in process_state.changes(before, process_state.take()))
    monkeypatch.undo()
    closed = io.StringIO()
    monkeypatch.setattr(sys, "stderr", closed)
    before = process_state.take()
    closed.close()
    assert process_state.changes(before, process_state.take()) == ["sys.stderr closed"]


def test_a_default_group_gone_or_replaced_is_named():
    before = process_state.take()
    after = process_state.take()
    mine = object()
    after.default_group = None
    assert process_state.changes(before, after, own_group=mine)[0].startswith(
        "the default process group destroyed")
    after.default_group = object()
    assert process_state.changes(before, after, own_group=mine) == [
        "the default process group replaced by another (a new init_process_group)"]
    after.default_group = mine
    assert process_state.changes(before, after, own_group=mine) == []
