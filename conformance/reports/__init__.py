"""The reports: each failure's text and each hook's verdict (:mod:`~conformance.reports.report`), the
terminal summary (:mod:`~conformance.reports.summary`), the JSON results document
(:mod:`~conformance.reports.results`, built by :mod:`~conformance.reports.results_plugin`), each hook's
grid (:mod:`~conformance.reports.matrix`), the baseline diff, the Markdown summary, and the report files'
locking and atomic publication (:mod:`~conformance.reports.report_files`).
"""
