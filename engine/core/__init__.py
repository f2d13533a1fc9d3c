"""The pure core: vLLM V1's scheduler and KV cache manager over integers (no torch,
numpy, clock or I/O), and the one step loop over an executor.

- :mod:`~engine.core.request`: a request's state and finish reasons
- :mod:`~engine.core.block_pool`, :mod:`~engine.core.kv_cache`: blocks, prefix hashes, the manager
- :mod:`~engine.core.policy`: one waiting-queue type per scheduling policy
- :mod:`~engine.core.scheduler`: the token-budget scheduler (``schedule`` / ``update_from_output``)
- :mod:`~engine.core.step_loop`: ``run_step`` and the ``Executor`` protocol the four executors implement
- :mod:`~engine.core.step_events`: the one place a finished step becomes a ``step`` event
"""
