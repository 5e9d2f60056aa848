"""The controller: the pytest process that plans the cases, starts the rank pools, sends each case to every
rank and turns their outcomes into one verdict per case.

Start at :mod:`~conformance.controller.runner` ("how a case travels"). The command is
:mod:`~conformance.controller.cli` (``conform``, ``python -m conformance``); the pytest plugin is
:mod:`~conformance.controller.pytest_plugin`; options come from :mod:`~conformance.controller.options`
and :mod:`~conformance.controller.settings`; the rank pools (:mod:`~conformance.controller.pools`, the protocol the
runner uses) are local, :mod:`~conformance.controller.local_pool` (ranks forked by
:mod:`~conformance.controller.zygote_client`), or
torchrun's, :mod:`~conformance.controller.remote`.
"""
