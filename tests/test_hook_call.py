"""What the recorders measure while a hook runs, measured without changing what the hook sees (issue 44): the
collectives a hook issues, counted from its process groups' own sequence numbers, and the ``Work`` s
``torch.distributed`` returns to it, seen by a profile function, in 2 gloo ranks.

A hook that builds ``dist.P2POp(dist.isend, ...)`` (``P2POp`` checks that its op *is* ``torch.distributed.isend``)
or compares ``dist.all_reduce`` with PyTorch's own runs inside both, as it would in training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from conformance.ranks.hook_call import counting_collectives, watching_works

WORLD_SIZE = 2


def _run(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    try:
        sub = dist.new_group([0, 1])
        peer = 1 - rank
        with counting_collectives() as count, watching_works() as works:
            assert dist.all_reduce is distributed_c10d.all_reduce and dist.isend is distributed_c10d.isend
            ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.zeros(3), peer)]
            for work in dist.batch_isend_irecv(ops):  # waited on: not left
                work.wait()
            dropped = dist.all_reduce(torch.ones(2**20), group=sub, async_op=True)  # neither waited on nor returned
            returned = dist.all_reduce(torch.ones(4), async_op=True)
            futured = dist.all_reduce(torch.ones(4), async_op=True)
            futured.get_future().wait()
            dist.all_reduce(torch.ones(2))
        # gloo numbers point-to-point ops too: 2 of the exchange, 4 all-reduces, on the groups they ran over
        assert count.known and count.issued == 6, (count.issued, count.group_sizes)
        assert sorted(count.group_sizes) == [2] * 6
        left = works.left(returned)
        assert left in ([dropped], []) and (dropped.is_completed() or left == [dropped]), left
        assert all(w is dropped for w in left)  # every other launched work had completed: waited for
        names = [name for name, _ in works.calls]
        assert names == ["all_reduce"] * 4, names  # batch_isend_irecv, the outermost call of the exchange, takes no group
        assert {size for _, size in works.calls} == {2}
        dropped.wait()
        returned.wait()
        # a call that raises before it is issued is seen by the profile function, though no group counts it
        with counting_collectives() as count, watching_works() as works:
            try:
                dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2))  # 3 is not 2 ranks x 2
            except (RuntimeError, ValueError):
                pass
        assert count.issued == 0 and works.calls == [("all_gather_into_tensor", 2)], (count.issued, works.calls)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_counting_and_watching_leave_torch_distributed_as_it_is(tmp_path):
    mp.spawn(_run, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)
