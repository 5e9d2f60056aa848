"""The rank side: the processes that run each case, one per rank.

:mod:`~conformance.ranks.zygote` forks them, :mod:`~conformance.ranks.worker` is each rank's loop
(:mod:`~conformance.ranks.remote_worker` under torchrun), :mod:`~conformance.ranks.checks` holds what a
rank runs for a case, :mod:`~conformance.ranks.diagnosis` names why a hook's result differs (over an API's
:mod:`~conformance.ranks.arithmetic`: native's :mod:`~conformance.ranks.reduction` as named fields, each cause a
change of them, worded by :mod:`~conformance.ranks.cause_words`; the calls a recorder keeps,
:mod:`~conformance.ranks.hook_call`), and :mod:`~conformance.ranks.process_state` fingerprints what a hook may
leave behind. What the controller runs too (spec loading, the link to it, bitwise comparison) is in
:mod:`conformance.shared`; the rank side never imports the controller (docs/layers.md).
"""
