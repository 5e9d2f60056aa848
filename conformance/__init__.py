"""commhook-conformance: a conformance suite for PyTorch gradient communication hooks.

Start with :class:`HookSpec` (the plug-in contract, ``conformance/spec.py``).
The rest of the package, by file:

* ``spec_loading.py``: load specs from ``module:ATTR`` and the ``conformance.hooks`` entry points;
* ``builtin_hooks/``: PyTorch's own hooks as specs, one module per hook API;
* ``pool.py`` / ``worker.py``: the persistent rank pool (controller and rank side);
* ``apis.py`` / ``adapters/``: the hook APIs, one adapter module each (validation, case plans,
  the rank checks);
* ``checks/``: the rank-check registry and what the adapters' checks share (the lock-step loop);
* ``compare.py``: bitwise comparison, ULP distance, mismatch reports;
* ``known_failures.py``: the expected-failure list in ``fixtures/``;
* ``pytest_plugin.py``: the pytest plugin; ``cli.py``: the ``conform`` command.
"""

from conformance.spec import HookSpec, LossyContract, SpecError

__all__ = ["HookSpec", "LossyContract", "SpecError", "__version__"]
__version__ = "0.1.0"
