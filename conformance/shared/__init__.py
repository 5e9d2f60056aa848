"""What the controller and the rank side both run, below both of them (docs/layers.md).

* :mod:`~conformance.shared.spec_loading`: ``module:ATTR`` hook targets and entry points, loaded by
  the controller for the session and again by every rank for its case;
* :mod:`~conformance.shared.suite_checkout`: the guard that keeps a checkout of this suite from
  shadowing a user's ``models``, ``fixtures`` or ``examples`` package, in both processes;
* :mod:`~conformance.shared.remote_link` and :mod:`~conformance.shared.rank_log`: the authenticated
  link between the controller and a rank on another node, and the bounded log of a rank's output;
* :mod:`~conformance.shared.compare`: tensors compared bit for bit (ranks against their reference,
  the controller across ranks);
* :mod:`~conformance.shared.standalone_main`: the reproducers' training loop and the torch-only helpers
  the rank checks use as they are (a reproducer copies this module whole);
* :mod:`~conformance.shared.training`: how the shared rank checks train (model, steps, learning rate,
  momentum), read by the checks' signatures and by the reproducer writer alike.

Nothing here imports :mod:`conformance.controller`, :mod:`conformance.ranks`,
:mod:`conformance.reports` or :mod:`conformance.reproducers` (``lint-imports``, pyproject.toml).
"""
