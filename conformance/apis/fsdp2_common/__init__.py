"""What the FSDP2 hook APIs share (no API of its own): the setup object and the builds, the meshes, the
registration rules, the all-reduce hook's recorder and the plans' helpers.

Each FSDP2 API (``fsdp2``: the reduce-scatter comm; ``fsdp2_all_reduce``; ``fsdp2_replica``) has its own
folder, whose ``standalone.py`` holds its :class:`~conformance.apis.fsdp2_common.setup.Fsdp2Setup`: the setter,
how the hook is bound, and its configs (mesh, the dimension that shards, the reference). The builds here read
that object and never an API's name.
"""
