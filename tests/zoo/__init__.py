"""Hook zoos for the suite's meta-tests: hooks known to conform and hooks known not to.

One module per hook API, or a package of one module per class of hook where a zoo grew past one
module (``ddp_hooks``, ``fsdp_hooks``, ``fsdp2_comms``, ``reach_hooks``). ``fsdp_hooks`` holds FSDP1 hooks, as
``HookSpec`` lists:
``KNOWN_GOOD`` (must pass every check), ``KNOWN_BAD`` (each must be caught by at least
one check) and ``EXPECTED_CATCH`` (which check catches each bad hook, and why). Specs are
importable by module path, e.g. ``tests.zoo.fsdp_hooks:KNOWN_GOOD``.
"""
