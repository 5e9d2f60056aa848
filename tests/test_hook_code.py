"""Which of a hook's own code its cases ran (issue 44): the rank side's meter (:mod:`conformance.ranks.hook_code`)
and the controller's analysis (:mod:`conformance.reports.hook_code`), on a hook package written for the test.

The package holds what real hooks hold: a hook whose other path needs a switch, a helper in a sibling module, a
function of the same file the hook never calls, a state class with a method nobody calls, and a future's callback
passed to ``.then``. Nothing here starts a rank: the meter runs in this process, as it does on a rank.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from conformance.ranks import hook_code as meter
from conformance.reports.hook_code import HookCodeLedger, hook_code_from_json, summarize

HOOKS = '''\
from .helpers import scale


class State:
    def __init__(self, group):
        self.group = group
        self.calls = 0

    def never_called(self):
        if self.calls:
            return 1
        return 0


def hook(state, values, big=False):
    state.calls += 1
    if big and state.calls > 3:  # switch
        values = [v * 2 for v in values]
    else:
        values = scale(values)
    return values


def chained(state, fut):
    def callback(f):
        if f:
            return 1
        return 2
    return fut.then(callback)


def unrelated(x):
    if x:
        return 1
    return 2
'''

HELPERS = '''\
def scale(values):
    out = []
    for v in values:
        if v < 0:
            out.append(-v)
        else:
            out.append(v)
    return out


def unused(x):
    if x:
        return x
    return 0
'''


@pytest.fixture
def package(tmp_path, monkeypatch):
    root = tmp_path / "src" / "myhooks"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "hooks.py").write_text(HOOKS)
    (root / "helpers.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path / "src")
    for name in [n for n in sys.modules if n.startswith("myhooks")]:
        del sys.modules[name]
    module = importlib.import_module("myhooks.hooks")
    meter._METER.hooks.clear()  # each test a process of its own: nothing of another test's hook carried over
    yield module
    meter.start(None)
    meter._METER.hooks.clear()


def _spec(hook, state=None):
    return types.SimpleNamespace(hook=hook, state=state)


def _run(spec, calls):
    meter.start(spec)
    for args in calls:
        with meter.running(spec.hook):
            spec.hook(*args)
    return meter.read()


def _summary(data, backend="gloo"):
    ledger = HookCodeLedger()
    ledger.add("h", [types.SimpleNamespace(hook_code=data)], backend)
    return summarize(ledger, "h")


def _line(module, text):
    return next(i for i, line in enumerate(open(module.__file__).read().splitlines(), 1) if text in line)


def test_a_branch_the_cases_never_took_is_named_with_its_line_and_source(package):
    state = package.State(None)
    data = _run(_spec(package.hook, package.State), [(state, [1, -2]), (state, [3])])
    code = _summary(data)
    assert code.measured
    switch = _line(package, "# switch")
    assert sorted(code.never_taken_lines()) == sorted([f"myhooks/hooks.py:{switch}",
                                                       f"myhooks/hooks.py:{_line(package, 'if self.calls:')}"])
    branch = next(b for b in code.never_taken if b.line == switch)
    assert branch.source == "if big and state.calls > 3:  # switch" and branch.how == "never true"
    # the state class's method nobody called: its lines never ran
    assert any(b.how == "the line never ran" for b in code.never_taken if b.line == _line(package, "if self.calls:"))
    # the helper of the sibling module ran and counts; the functions nothing called are not the hook's code
    assert set(code.files) == {"myhooks/hooks.py", "myhooks/helpers.py"}
    assert code.files["myhooks/helpers.py"][2:] == (4, 4)  # for and if: every branch of scale taken
    assert "unused" not in str(code.to_json()) and "unrelated" not in str(code.to_json())
    assert code.text.startswith("hook code: 5 of 8 branches taken; never taken: ") and f"hooks.py:{switch}" in code.text
    assert sorted(code.definitions) == ["myhooks/hooks.py:State", "myhooks/hooks.py:hook"]


def test_once_the_switch_runs_its_branch_is_taken(package):
    state = package.State(None)
    data = _run(_spec(package.hook, package.State), [(state, [1], True)] * 5 + [(state, [-1])])
    code = _summary(data)
    assert f"myhooks/hooks.py:{_line(package, '# switch')}" not in code.never_taken_lines()


def test_data_from_every_rank_and_case_is_merged(package):
    state = package.State(None)
    first = _run(_spec(package.hook, package.State), [(state, [1])])
    second = _run(_spec(package.hook, package.State), [(package.State(None), [1], True)] * 5)
    ledger = HookCodeLedger()
    ledger.add("h", [types.SimpleNamespace(hook_code=first), types.SimpleNamespace(hook_code={})], "gloo")
    assert f"myhooks/hooks.py:{_line(package, '# switch')}" in summarize(ledger, "h").never_taken_lines()
    ledger.add("h", [types.SimpleNamespace(hook_code=second)], "gloo")
    assert ledger.cases["h"] == 2
    assert f"myhooks/hooks.py:{_line(package, '# switch')}" not in ledger.summary("h").never_taken_lines()


class _Future:
    def then(self, callback):
        return callback(True)


def test_a_future_callback_is_not_measured_on_gloo_and_counts_elsewhere(package):
    data = _run(_spec(package.chained), [(None, _Future())])
    on_gloo = _summary(data, "gloo")
    assert [w for w, _ in on_gloo.not_measured] == [f"myhooks/hooks.py:{_line(package, 'def callback')}"]
    assert on_gloo.branches == (0, 0) and "not measured on gloo" in on_gloo.text
    on_nccl = _summary(data, "nccl")
    assert on_nccl.not_measured == () and on_nccl.branches == (1, 2)  # it ran inline: 'if f' was only ever true


def test_what_is_not_python_is_n_a_with_the_reason(package):
    assert _run(_spec(len), []) == {"arcs": {}, "roots": [], "problem": "len has no Python source (a C++ hook or a "
                                                                       "compiled extension)"}
    code = _summary(_run(_spec(len), []))
    assert not code.measured and code.text == "hook code: n/a (len has no Python source (a C++ hook or a compiled " \
                                              "extension))"
    cpp = types.SimpleNamespace(not_python="a C++ built-in hook", __call__=None)
    assert _summary(_run(_spec(cpp), [])).reason == "a C++ built-in hook"
    assert summarize(HookCodeLedger(), "h", enabled=False).text == "hook code: n/a (not measured: --hook-coverage off)"


def test_measuring_nothing_when_off_and_the_json_round_trips(package):
    meter.start(_spec(package.hook), enabled=False)
    with meter.running(package.hook):
        package.hook(package.State(None), [1])
    assert meter.read() == {}
    code = _summary(_run(_spec(package.hook, package.State), [(package.State(None), [1])]))
    assert hook_code_from_json(code.to_json()) == code


def test_what_is_traced_is_the_hooks_package_and_never_torch_or_the_suite(package, tmp_path):
    assert meter.trace_path(package.__file__) == str((tmp_path / "src" / "myhooks").resolve()) + "/"
    lone = tmp_path / "lone.py"
    lone.write_text("def h(): pass\n")
    assert meter.trace_path(str(lone)) == str(tmp_path.resolve()) + "/"  # a module in no package: its folder
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_hooks
    assert meter.trace_path(torch_hooks.__file__) == torch_hooks.__file__  # PyTorch's own: its file alone
    assert meter.trace_path(meter.__file__) == meter.__file__
    import functools

    assert meter.root_of(functools.partial(package.hook, None))[1] == "hook"
    assert meter.root_of(package.State(None))[1] == "State"
    assert meter.root_of(package.State(None).never_called)[1] == "State.never_called"
    assert meter.root_of(len) is None
