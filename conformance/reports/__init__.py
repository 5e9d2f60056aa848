"""The reports: each failure's text and each hook's verdict (:mod:`~conformance.reports.report`, a
:class:`~conformance.reports.verdict.Verdict`), the one classification of pytest's reports
(:mod:`~conformance.reports.bookkeeper`), the terminal summary (:mod:`~conformance.reports.summary`), the JSON
results document (:mod:`~conformance.reports.results`, written by :mod:`~conformance.reports.results_plugin`),
each hook's grid (:mod:`~conformance.reports.matrix`), the baseline diff, the Markdown summary, and the report
files' locking and atomic publication (:mod:`~conformance.reports.report_files`).
"""
