"""The doctor's rules: each reads a :class:`~doctor.facts.RunFacts` and returns
the findings it sees, with the evidence (steps, requests, numbers from the
events), the likely cause and the fix computed through the budget formula
(:mod:`doctor.budget`). The monitor's Diagnosis panel runs these same rules on
its live fold; ``engine doctor`` adds the simulator's what-if to each fix
(:mod:`doctor.remedies`).

The rules follow the background's operations guide (failure modes and the five
metrics that cover most diagnoses): startup refused because the context does not
fit, out of memory at startup, the pool binds (KV usage near 1.0 with
preemptions), ``--max-num-seqs`` binds (queue grows with low KV usage), latency
spikes when long documents arrive, decode starved by prefill, TTFT rising while
the token budget binds, a low prefix-cache hit rate with a shared prefix, poor
scaling with tensor parallelism (collectives dominating the step), pipeline stages
idling (the bubble) and data-parallel ranks loaded unevenly.

- ``finding``: ``Finding``, its severities and ``engine doctor``'s exit status
- ``steps``: runs of steps a limit holds, and step ranges and durations worded
- ``pool_fixes``: the fixes that grow the KV pool (fp8 KV, a higher memory cap)
- ``startup``: startup refused (the context does not fit) and out of memory at startup
- ``kv_pool``: the KV pool or ``--max-num-seqs`` binds; the shared prefix evicted
- ``latency``: long-prompt spikes, decode starved by prefill, TTFT while the token budget binds
- ``parallelism``: tensor-parallel collectives, a hot MoE expert, the pipeline bubble, data-parallel imbalance
- ``requests``: rules that name one request (stuck engine, held slots, prefix misses, thrashing, lost sessions)
- ``stall``: an engine core that made no progress
- ``registry``: the rules in order, and ``diagnose``
"""
