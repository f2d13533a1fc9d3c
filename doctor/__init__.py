"""``engine doctor``: findings with the fix in numbers, over events, live servers and vLLM logs.

- ``facts``: the fold of events into ``RunFacts`` (what the rules read)
- ``rules``: one function per failure mode, by concept, and ``diagnose``
- ``budget``: the run's memory plan rebuilt from its startup events, with changed flags
- ``remedies``: the simulator's what-if for each fix
- ``inputs``: recordings, live ``/events`` streams, vLLM logs as ``RunFacts``
- ``vllm_log``: logparse's checks worded as findings
- ``vllm_dp``: a real vLLM's data-parallel balance
- ``vllm_stall``: a real vLLM's stall from its ``/metrics``
- ``report``, ``cli``: the text/JSON report and the command behind the ``kvscope.doctor`` entry point
"""
