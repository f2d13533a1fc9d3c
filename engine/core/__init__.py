"""The pure core: vLLM V1's scheduler and KV cache manager over integers (no torch,
numpy, clock or I/O), and the one step loop over an executor.

- ``request``: a request's tokens, stop rules, status and timestamps
- ``sampling_params``: sampling parameters, checked once
- ``block_pool``: blocks, reference counts, the LRU free queue, prefix hashes, deltas
- ``kv_cache``: ``KVCacheManager``, the scheduler's one face on the cache
- ``kv_cache_coordinator``: one single-type manager per KV cache group; hits, allocation, freeing
- ``single_type_kv_cache``: the full-attention and sliding-window managers
- ``kv_cache_groups``: KV cache specs and vLLM's grouping of layers
- ``encoder_cache``: a vision-language request's encoder budget and cache
- ``policy``: one waiting-queue type per scheduling policy
- ``scheduler``: the token-budget scheduler (``schedule`` / ``update_from_output``)
- ``step_plan``: one ``schedule`` call's budgets and decisions; why the requests left waiting waited
- ``scheduler_config``: ``SchedulerConfig``, the scheduler's limits under vLLM's flag names
- ``step_loop``: ``run_step`` and the ``Executor`` protocol the four executors implement
- ``step_events``: the one place a finished step becomes a ``step`` event
"""
