"""Repository-level pytest configuration.

Loads the conformance plugin, so that from a checkout ``pytest conformance/suite
--hook pkg.mod:SPEC`` is the same as ``conform --hook pkg.mod:SPEC``, and the
project's own tests (``tests/``) can use its options and fixtures.
"""

pytest_plugins = ["conformance.controller.pytest_plugin"]
