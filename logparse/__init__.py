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
- ``explain``: records to an explanation: ledger, checks, failures, the plan beside vLLM's
- ``options``: what the user told beyond the log
- ``fold``: the records folded as they stream past
- ``coverage``: how much of a log logparse explains
- ``check``: a check, and the printed digits' tolerance
- ``vllm_budget``: vLLM's own budget from the log
- ``kvscope_plan``: kvscope's plan for the log's model and flags
- ``derived_checks``: the figures checked against each other
- ``hybrid_checks``: a hybrid KV layout's checks
- ``failures``: failures explained with fixes
- ``kvscope_recording``: a kvscope run (``--profile``) beside the log
- ``startup_phases``: each startup phase's seconds from a log; two starts phase by phase
- ``reconcile``: the log's own figures set beside the plan
- ``render``: terminal, Markdown and JSON output
- ``catalogue``: every logger call of vLLM's releases, as data
"""
