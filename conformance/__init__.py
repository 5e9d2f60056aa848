"""commhook-conformance: a conformance suite for PyTorch gradient communication hooks.

Start with :class:`HookSpec` (the plug-in contract, ``conformance/spec.py``).
The rest of the package, in parts that import one another only downwards (docs/layers.md gives
the order, which ``lint-imports`` checks):

* ``apis/``: the hook APIs, a folder each (its plan, its models, its arithmetic, its extras), and
  the registry that loads their plans;
* ``controller/``: the pytest process (plugin, settings, the runner, the rank pools, its replay policy);
* ``ranks/``: the rank processes (worker, zygote) and what they run (``checks/``, the diagnosis);
* ``reports/`` and ``reproducers/``: what a run writes (failure text, verdicts, JSON, grids, baseline,
  Markdown; standalone files);
* ``shared/``: what the controller and the ranks both run (spec loading, the rank link and log,
  bitwise comparison, the reproducers' torch-only loop);
* the foundation: ``protocol.py``, ``cases.py``, ``signatures.py``, ``exit_codes.py``, ``ulps.py``.
"""

import gc as _gc

# torch's import makes some 200,000 objects, over which the cyclic collector would run again and again (about
# 0.5 s of CPU in each process: the controller, the zygote, every rank started fresh); nothing it makes is garbage.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from conformance.spec import HookSpec, LossyContract, Switches
    from conformance.signatures import SpecError
finally:
    if _collecting:
        _gc.enable()

__all__ = ["HookSpec", "LossyContract", "SpecError", "Switches", "__version__"]
__version__ = "0.1.0"
