"""Standalone reproducers: one Python file per failed case, that runs where the suite is not installed.

A reproducer imports only the standard library, torch and the hook's own
module. Written into it, as the suite runs them, and only as far as its case
runs them (:mod:`conformance.reproducers.sources`): the reference model's class
(``models/<module>.py``, and of ``models/base.py`` what the model inherits and
the file calls), the API's standalone part for the case's one config
(``conformance/apis/<api>/standalone.py``: how the suite builds the native and
the hooked model, which the suite's own models use too) and the lock-step loop
of its check (:mod:`conformance.shared.standalone_main` and its pieces), each helper
the file calls once written at its call (:mod:`conformance.reproducers.inline`). The
case (world size, variant, reduce dtype, seeds, steps, the hard inputs' values)
is a literal ``CASE`` dict. ``python file.py`` starts the case's ranks itself on CPUs (gloo) or
GPUs (NCCL, one per process) and exits 1 where the difference reproduces, 0 where
it does not, 2 where it could not run (the hook's module does not import: the
error is named); under ``torchrun --nproc-per-node N file.py`` it runs as the
workers and prints the same verdict line. ``--without-hook`` builds both copies
native (it must exit 0). Where the hook's module imports ``conformance``, the file
needs the suite, and says so (:func:`~conformance.reproducers.writer.needs_the_suite`).

:func:`conformance.reproducers.writer.write_reproducer` writes one; the runner
calls it for every failed case of a hook under ``--write-reproducers DIR``, and
for no case that passed.
"""
