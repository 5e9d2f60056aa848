"""The rank side: the processes that run each case, one per rank.

:mod:`~conformance.ranks.zygote` forks them, :mod:`~conformance.ranks.worker` is each rank's loop
(:mod:`~conformance.ranks.remote_worker` under torchrun), :mod:`~conformance.ranks.checks` holds what a
rank runs for a case, :mod:`~conformance.ranks.diagnosis` names why a hook's result differs,
:mod:`~conformance.shared.compare` compares tensors bit for bit, and
:mod:`~conformance.ranks.process_state` fingerprints what a hook may leave behind.
"""
