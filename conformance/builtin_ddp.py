"""PyTorch's DDP communication hooks, as specs (filled in by the DDP work)."""

DDP_HOOKS: list = []
