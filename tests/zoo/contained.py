"""Hooks that hang or kill a rank, for the containment tests.

They break the pool on purpose: the suite must time the case out (or notice
the dead rank), report what every rank was doing, restart the pool and go on.
Both are NO_SHARD-only and misbehave on rank 1 only, as a real bug usually
does: rank 0 is then left blocked in the collective its peer never joins.
A third aborts rank 1 once per run only (a rank death that came from outside
the case, as a machine's or an earlier case's would), then reduces correctly:
the suite's re-run in fresh ranks must pass it. ``GROUPS``: one hook raises once
with a collective of its own group unmatched (the suite must not run its next
case in those ranks), one finishes every case with such a collective left
behind (the case that did it fails).
``INTERRUPTIBLE`` is for the tests that stop the controller mid-case
(tests/test_interrupt.py): a passing hook, then one that never returns.
``UNRULY`` is for the rank output and memory limits (tests/test_rank_limits.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook

from conformance.spec import HookSpec


def hang_on_rank1(state, grad):
    """Rank 1 sleeps instead of reducing; rank 0 waits for it in all_reduce."""
    if dist.get_rank(state.process_group) == 1:
        time.sleep(3600)
    allreduce_hook(state, grad)


def crash_on_rank1(state, grad):
    """Rank 1's process exits in the middle of backward."""
    if dist.get_rank(state.process_group) == 1:
        os._exit(17)
    allreduce_hook(state, grad)


def abort_once_on_rank1(state, grad):
    """Rank 1 aborts (SIGABRT, as a C++ ``std::terminate`` does) at its first call of the run, then reduces
    correctly. "Once" is kept in the file ``$CONFORM_TEST_CRASH_ONCE``, so it holds across rank processes;
    without that variable the hook never aborts."""
    marker = os.environ.get("CONFORM_TEST_CRASH_ONCE")
    if marker and dist.get_rank(state.process_group) == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("zoo: rank 1 aborts once", flush=True)
        os.abort()
    allreduce_hook(state, grad)


def _exit_once_on_rank1(state, grad, how):
    """Rank 1 ends its own process with exit status 3 (``how``: ``"sys.exit"`` or ``"os._exit"``) at its first call
    of the run, then reduces correctly: the case must fail, not run again in fresh ranks as a death by signal
    does. "Once" is kept in the file ``$CONFORM_TEST_EXIT_ONCE.<how>``, so it holds across rank processes (a
    re-run would pass); without that variable the hook never exits."""
    marker = os.environ.get("CONFORM_TEST_EXIT_ONCE")
    if marker and dist.get_rank(state.process_group) == 1 and not os.path.exists(f"{marker}.{how}"):
        open(f"{marker}.{how}", "w").close()
        print(f"zoo: rank 1 calls {how}(3) once", flush=True)
        if how == "sys.exit":
            sys.exit(3)
        os._exit(3)
    allreduce_hook(state, grad)


def sys_exit_once_on_rank1(state, grad):
    """``sys.exit(3)`` on rank 1 at its first call of the run (:func:`_exit_once_on_rank1`)."""
    _exit_once_on_rank1(state, grad, "sys.exit")


def os_exit_once_on_rank1(state, grad):
    """``os._exit(3)`` on rank 1 at its first call of the run (:func:`_exit_once_on_rank1`)."""
    _exit_once_on_rank1(state, grad, "os._exit")


_GROUP = []


def raise_with_a_collective_mid_way(state, grad):
    """At its first call of the run (kept in the file ``$CONFORM_TEST_RAISE_ONCE``): rank 0 starts an all-reduce on
    a process group of the hook's own that rank 1 never joins, then both raise, as code that raises between two
    collectives of a group does (a hook, or PyTorch in the reference). Later calls first all-reduce a probe of
    ones on that group (raising where it does not sum to the group size), then reduce as ``allreduce_hook``:
    in ranks the suite kept after the raise, the probe pairs with the stale all-reduce (1000) and fails."""
    if not _GROUP:  # collective, in the same order on every rank
        _GROUP.append(dist.new_group(list(range(dist.get_world_size()))))
    group = _GROUP[0]
    marker = os.environ.get("CONFORM_TEST_RAISE_ONCE")
    if marker and not os.path.exists(marker):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.full((1,), 1000.0), group=group, async_op=True)
        dist.barrier()  # both ranks are past the marker's test before it is written
        if dist.get_rank() == 0:
            open(marker, "w").close()
        raise RuntimeError("zoo: raised between two collectives of a group")
    probe = torch.ones(1)
    dist.all_reduce(probe, group=group)
    if probe.item() != dist.get_world_size(group):
        raise RuntimeError(f"zoo: the hook's group is out of step (a probe of ones summed {probe.item():g})")
    allreduce_hook(state, grad)


_LEFT = []


def leave_a_collective_behind(state, grad):
    """Reduces as ``allreduce_hook`` does, but at its first call in a process, rank 0 also starts an all-reduce on
    a group of the hook's own that no other rank joins, and never waits for it: every rank finishes the case,
    the default group is in step, and that group is a collective apart."""
    if not _LEFT:
        _LEFT.append(dist.new_group(list(range(dist.get_world_size()))))  # collective, same order on every rank
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1), group=_LEFT[0], async_op=True)
    allreduce_hook(state, grad)


def hang_in_hook(state, grad):
    """Never returns: rank 0 waits on a future nobody completes; rank 1 sleeps in C holding the GIL,
    so only the kernel's parent-death signal can end it. Entering the hook creates the file
    ``$CONFORM_TEST_HOOK_ENTERED.rank<r>`` when that variable is set (tests wait for it)."""
    rank = dist.get_rank(state.process_group)
    marker = os.environ.get("CONFORM_TEST_HOOK_ENTERED")
    if marker:
        open(f"{marker}.rank{rank}", "w").close()
    if rank == 1:
        ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held
    torch.futures.Future().wait()


def noisy_then_raise(state, grad):
    """Prints 3 MB on every rank, then raises: the failure must say how much output it leaves out."""
    print("noisy hook starts", flush=True)
    for _ in range(48):
        print("x" * 65535, flush=True)
    raise RuntimeError("noisy hook gives up")


_LEAKED = []


def leak_once(state, grad):
    """Rank 1 keeps 200 MiB (touched, so resident) at its first call, then reduces correctly."""
    if dist.get_rank(state.process_group) == 1 and not _LEAKED:
        _LEAKED.append(b"\x01" * (200 * 2**20))
    allreduce_hook(state, grad)


HANG = HookSpec(name="zoo_hang_rank1", api="fsdp", hook=hang_on_rank1, state=DefaultState,
                description="rank 1 never joins the all-reduce")
CRASH = HookSpec(name="zoo_crash_rank1", api="fsdp", hook=crash_on_rank1, state=DefaultState,
                 description="rank 1 exits during backward")
CRASH_ONCE = HookSpec(name="zoo_abort_once_rank1", api="fsdp", hook=abort_once_on_rank1, state=DefaultState,
                      description="rank 1 aborts at its first call of the run, then reduces correctly")
SYS_EXIT_ONCE = HookSpec(name="zoo_sys_exit_once_rank1", api="fsdp", hook=sys_exit_once_on_rank1, state=DefaultState,
                         description="rank 1 calls sys.exit(3) at its first call of the run, then reduces correctly")
OS_EXIT_ONCE = HookSpec(name="zoo_os_exit_once_rank1", api="fsdp", hook=os_exit_once_on_rank1, state=DefaultState,
                        description="rank 1 calls os._exit(3) at its first call of the run, then reduces correctly")
RAISE_MID_WAY = HookSpec(name="zoo_raise_mid_way", api="fsdp", hook=raise_with_a_collective_mid_way,
                         state=DefaultState, description="raises once, leaving a collective of its group unmatched")
LEAVES_A_COLLECTIVE = HookSpec(name="zoo_leaves_a_collective", api="fsdp", hook=leave_a_collective_behind,
                               state=DefaultState, description="rank 0 leaves an all-reduce of its own group unjoined")
GROUPS = [RAISE_MID_WAY, LEAVES_A_COLLECTIVE]
GOOD = HookSpec(name="zoo_plain_allreduce", api="fsdp", hook=allreduce_hook, state=DefaultState,
                description="PyTorch's allreduce_hook, to show the run goes on")
HANG_IN_HOOK = HookSpec(name="zoo_hang_in_hook", api="fsdp", hook=hang_in_hook, state=DefaultState,
                        description="never returns from the hook, rank 1 holding the GIL")
NOISY = HookSpec(name="zoo_noisy", api="fsdp", hook=noisy_then_raise, state=DefaultState,
                 description="prints 3 MB, then raises")
LEAKY = HookSpec(name="zoo_leak_once", api="fsdp", hook=leak_once, state=DefaultState,
                 description="rank 1 keeps 200 MiB, then reduces correctly")
ALL = [HANG, CRASH, CRASH_ONCE, SYS_EXIT_ONCE, OS_EXIT_ONCE, GOOD]
UNRULY = [NOISY, LEAKY, GOOD]
INTERRUPTIBLE = [GOOD, HANG_IN_HOOK]
