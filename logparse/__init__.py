"""The ``logparse`` command: a real vLLM log read into records and explained beside kvscope's
memory formula.

- ``cli``: ``logparse explain / summary / diff``
- ``patterns``: hand-written log formats as data
- ``prefixes``: a log's own line prefix, learned from the log
- ``parser``: physical lines into records
- ``fastscan``: ``summary``'s fast path
- ``tracebacks``: where a failure happened, from its frames
- ``failed_start``: whether, where and why a start failed
- ``completeness``: a cut log named
- ``explain``: the ledger, checks, failures and the plan comparison
- ``startup_phases``: each startup phase's seconds from a log; two starts phase by phase
- ``reconcile``: the log's own figures set beside the plan
- ``render``: terminal, Markdown and JSON output
- ``catalogue``: every logger call of vLLM's releases, as data
"""
