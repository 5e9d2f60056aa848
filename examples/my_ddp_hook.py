"""The README's DDP plug-in example hook (torch only: its spec is in my_specs.py), tested by
tests/test_readme_example.py."""

import torch.distributed as dist


def allreduce_mean(process_group, bucket):
    """DDP's own averaging: multiply by 1/world_size (as the Reducer does), then SUM."""
    tensor = bucket.buffer().mul_(1.0 / dist.get_world_size(process_group))
    fut = dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def process_group_state(process_group):
    """The hook's state: the process group DDP reduces over."""
    return process_group
