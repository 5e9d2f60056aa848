"""commhook-conformance: a conformance suite for PyTorch gradient communication hooks.

Start with :class:`HookSpec` (the plug-in contract, ``conformance/spec.py``).
The rest of the package, in four parts (README's "Layout" lists every module):

* ``apis/``: the hook APIs, a folder each (its plan, its models, its arithmetic, its extras);
* ``controller/``: the pytest process (plugin, settings, spec loading, the runner, the rank pools);
* ``ranks/``: the rank processes (worker, zygote) and what they run (``checks/``, the diagnosis,
  bitwise comparison);
* ``reports/``: what a run writes (failure text, verdicts, JSON, grids, baseline, Markdown).
"""

from conformance.spec import HookSpec, LossyContract, SpecError

__all__ = ["HookSpec", "LossyContract", "SpecError", "__version__"]
__version__ = "0.1.0"
