"""A rank that raises is the hook's failure only where PyTorch's own default hook runs the case.

On a GPU machine the suite once failed every forked rank's first backward pass (the zygote had run one,
and autograd marks every later fork bad), and reported PyTorch's own hooks as DOES NOT CONFORM, exit 1.
Here a machine that cannot run a backward pass in a rank is simulated with a ``sitecustomize`` module
(every rank process's ``torch.autograd.backward`` raises): every hook's case must be NOT RUN, with the
reason, and exit 10; never a failure of the hook. On a sound machine a hook that raises still fails, and
its failure says that the default hook, replayed, ran the case to the end.

A machine whose native path is not bit-reproducible (``tests/zoo/nondeterministic_native``: a linear layer that
moves one element by one ULP at random) makes an exact hook's case NOT RUN, the machine's, once native trained
twice gives other bits; a hook whose own arithmetic is wrong still fails there.
"""

from __future__ import annotations

import re
import textwrap

from conformance.exit_codes import RUN_ERROR
from tests.meta_helpers import run_suite

BROKEN_MACHINE = textwrap.dedent("""
    import os

    import torch

    _real_backward = torch.autograd.backward


    def _backward(*args, **kwargs):
        if os.environ.get("CONFORM_RANK") is not None:
            raise RuntimeError("simulated: this machine cannot run a backward pass in a rank process")
        return _real_backward(*args, **kwargs)


    torch.autograd.backward = _backward
""")

#: A good hook, a hook that raises by itself, and PyTorch's own default hook for the case, on one case each.
ARGS = ["--hook", "tests.zoo.contained:GOOD", "--hook", "tests.zoo.contained:NOISY", "--with-builtins",
        "-k", "test_averaging and NO_SHARD and ws2 and (zoo_plain or zoo_noisy or allreduce_hook)",
        "--extra-world-size", "0", "-q"]


def test_a_machine_that_cannot_train_blames_no_hook(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BROKEN_MACHINE)
    run = run_suite(ARGS, str(tmp_path / "broken.xml"), timeout=600, pythonpath=[str(tmp_path)])
    assert run.returncode == RUN_ERROR, run.output[-3000:]
    assert "DOES NOT CONFORM" not in run.output
    hooks = run.by_hook()
    assert set(hooks) == {"allreduce_hook", "zoo_plain_allreduce", "zoo_noisy"}
    for name, cases in hooks.items():
        assert [c.outcome for c in cases] == ["skipped"], (name, cases)
        assert "simulated: this machine cannot run a backward pass" in cases[0].properties["not_run"]
    # The default hook is its own evidence; the others are replayed against it, in ranks of its own.
    assert re.search(r"^allreduce_hook +NOT RUN \(PyTorch's own default hook for this case \(allreduce_hook, the "
                     r"hook under test\) cannot run it here", run.output, re.MULTILINE), run.output[-3000:]
    for name in ("zoo_plain_allreduce", "zoo_noisy"):
        assert re.search(rf"^{name} +NOT RUN \(PyTorch's own default hook for this case \(allreduce_hook\), replayed "
                         r"in ranks of its own, fails it the same way: a rank raised RuntimeError: simulated",
                         run.output, re.MULTILINE), run.output[-3000:]


def test_a_hook_that_raises_on_a_sound_machine_still_fails(tmp_path):
    run = run_suite(ARGS, str(tmp_path / "sound.xml"), timeout=600)
    hooks = run.by_hook()
    assert [c.outcome for c in hooks["zoo_noisy"]] == ["failed"], run.output[-3000:]
    assert ("(PyTorch's own default hook for this case, allreduce_hook, replayed in ranks of its own, runs it to "
            "the end: what failed above is this hook's doing)") in hooks["zoo_noisy"][0].message
    assert [c.outcome for c in hooks["zoo_plain_allreduce"]] == ["passed"]
    assert [c.outcome for c in hooks["allreduce_hook"]] == ["passed"]


def test_a_pool_that_could_not_start_says_why_in_one_line_and_keeps_the_whole_error():
    """The one-GPU machine's NCCL pool once said only "rank 0 could not join the process group:" and promised
    more in a case report that did not have it."""
    from conformance.controller.failures import pool_not_run

    error = ("rank pool of world size 1: rank 0 could not join the process group:\n"
             "Traceback (most recent call last):\n  File \"worker.py\", line 160, in start\n"
             "torch.distributed.DistBackendError: NCCL error: unhandled cuda error\nLast error: initialization error")
    not_run = pool_not_run(error, 1)
    assert not_run.reason == ("its rank pool of world size 1 could not start: rank 0 could not join the process group: "
                              "torch.distributed.DistBackendError: NCCL error: unhandled cuda error Last error: "
                              "initialization error (the whole error below); the run's failure, not the hook's")
    assert not_run.msg == f"NOT RUN: {not_run.reason}\n{error}"
    one_line = pool_not_run("rank pool of world size 2: rank 1 exited during start-up (exit code 3)", 2)
    assert one_line.msg == ("NOT RUN: its rank pool of world size 2 could not start: rank 1 exited during start-up "
                            "(exit code 3); the run's failure, not the hook's")


#: A machine whose native path gives other bits on every run (``tests/zoo/nondeterministic_native``).
NONDETERMINISTIC = str(__import__("pathlib").Path(__file__).parent / "zoo" / "nondeterministic_native")
#: A hook exact on whatever it is handed, one whose own arithmetic is wrong, and PyTorch's own, on one case each.
NATIVE_ARGS = ["--hook", "tests.zoo.ddp_hooks:ALL", "--with-builtins", "--extra-world-size", "0", "-q",
               "-k", "test_ddp_parity and default-nested_wrapped-ws2 and not 2nodes and "
                     "(good_mean_allreduce- or bad_sum_no_average or allreduce_hook-)"]


def test_native_that_is_not_bit_reproducible_is_the_machines_not_the_hooks(tmp_path):
    """Native trained twice gives other bits: an exact hook's case is NOT RUN, the machine's, with the reason;
    a hook whose own arithmetic is wrong still fails, its cause found from the gradients it was handed."""
    run = run_suite(NATIVE_ARGS, str(tmp_path / "irreproducible.xml"), timeout=600, pythonpath=[NONDETERMINISTIC])
    hooks = run.by_hook()
    assert set(hooks) == {"ddp_allreduce_hook", "good_mean_allreduce", "bad_sum_no_average"}, run.output[-3000:]
    for name in ("ddp_allreduce_hook", "good_mean_allreduce"):
        [case] = hooks[name]
        assert case.outcome == "skipped", (name, case.message[-2000:])
        why = case.properties["not_run"]
        assert why.startswith("native is not bit-reproducible here: the suite's reference ("), why
        assert "trained alone twice on the case's ranks from the same seed and inputs, ends with other bits" in why
    [bad] = hooks["bad_sum_no_average"]
    assert bad.outcome == "failed" and "SUM" in bad.message, bad.message[-2000:]
    assert "not bit-reproducible" not in bad.message
    assert run.returncode == RUN_ERROR, run.output[-3000:]  # a NOT RUN case: the run could not check every hook


def test_on_a_sound_machine_native_keeps_its_bits_and_the_exact_hooks_pass(tmp_path):
    run = run_suite(NATIVE_ARGS, str(tmp_path / "sound.xml"), timeout=600)
    hooks = run.by_hook()
    assert [c.outcome for c in hooks["good_mean_allreduce"]] == ["passed"], run.output[-3000:]
    assert [c.outcome for c in hooks["ddp_allreduce_hook"]] == ["passed"]
    assert [c.outcome for c in hooks["bad_sum_no_average"]] == ["failed"]
