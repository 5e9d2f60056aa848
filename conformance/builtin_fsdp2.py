"""FSDP2 reference comms, as specs (filled in by the FSDP2 work)."""

FSDP2_HOOKS: list = []
