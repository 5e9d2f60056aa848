"""What the controller and the rank side both run, below both of them (docs/layers.md).

* :mod:`~conformance.shared.spec_loading`: ``module:ATTR`` hook targets and entry points, loaded by
  the controller for the session and again by every rank for its case;
* :mod:`~conformance.shared.suite_checkout`: the guard that keeps a checkout of this suite from
  shadowing a user's ``models``, ``fixtures`` or ``examples`` package, in both processes;
* :mod:`~conformance.shared.remote_link` and :mod:`~conformance.shared.rank_log`: the authenticated
  link between the controller and a rank on another node, and the bounded log of a rank's output;
* :mod:`~conformance.shared.compare`: tensors compared bit for bit (ranks against their reference,
  the controller across ranks);
* :mod:`~conformance.shared.standalone_main`: the reproducers' lock-step loop, with its pieces
  :mod:`~conformance.shared.standalone_compare` (the bitwise comparison),
  :mod:`~conformance.shared.standalone_inputs` (each check's inputs) and
  :mod:`~conformance.shared.standalone_launch` (``python FILE`` starting the ranks): torch only, and
  used by the rank checks as they are (a reproducer copies what its case runs of them).

Nothing here imports :mod:`conformance.controller`, :mod:`conformance.ranks`,
:mod:`conformance.reports` or :mod:`conformance.reproducers` (``lint-imports``, pyproject.toml).
"""
