"""DDP's recorder reports contract violations in the same order on every run, whatever order the futures finish in."""

from __future__ import annotations

import torch

from conformance.apis.ddp.recorder import DDPHookRecorder


class FakeBucket:
    """What the recorder reads of a ``dist.GradBucket``."""

    def __init__(self, index: int, numel: int):
        self._index, self._buffer = index, torch.zeros(numel)

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def parameters(self):
        return []


def test_violations_read_by_step_then_bucket_whatever_order_the_futures_finish():
    futures = {}

    def hook(state, bucket):  # a future longer than the bucket, completed later, by the test
        futures[bucket.index()] = torch.futures.Future()
        return futures[bucket.index()]

    recorder = DDPHookRecorder(hook, rank=0, names={})
    for step in (0, 1):
        recorder.step = step
        for index in (0, 1, 2):
            recorder(None, FakeBucket(index, 4 + index))
        for index in (2, 0, 1):  # the collectives finish out of order
            futures[index].set_result(torch.zeros(10))
    order = [(f.step, f.message.split(":")[0]) for f in recorder.violations]
    assert order == [(s, f"bucket {i}") for s in (0, 1) for i in (0, 1, 2)]
    assert all("shape (10,) instead of" in f.message and f.kind == "contract" for f in recorder.violations)
    assert [f.step for f in recorder.findings_so_far(1)] == [1, 1, 1]


def test_the_twenty_kept_are_the_first_by_step_and_bucket():
    futures = {}

    def hook(state, bucket):
        futures[(recorder.step, bucket.index())] = torch.futures.Future()
        return futures[(recorder.step, bucket.index())]

    recorder = DDPHookRecorder(hook, rank=0, names={})
    for step in range(3):
        recorder.step = step
        for index in range(8):
            recorder(None, FakeBucket(index, 4))
    for key in sorted(futures, reverse=True):  # the last step's buckets finish first
        futures[key].set_result(torch.zeros(5))
    kept = [(f.step, int(f.message.split(":")[0].split()[1])) for f in recorder.violations]
    assert kept == [(s, i) for s in range(3) for i in range(8)][:20]
