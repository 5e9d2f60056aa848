"""A spec whose hook does not fit its api (issue 48): PyTorch's DDP ``allreduce_hook`` given as ``api="fsdp"``.
Importing it raises the SpecError that ``conform --hook tests.data.mismatched_api:SPEC`` exits 4 with."""

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from conformance.spec import HookSpec

SPEC = HookSpec(name="ddp_hook_as_fsdp", api="fsdp", hook=default_hooks.allreduce_hook, state=lambda pg: pg)
