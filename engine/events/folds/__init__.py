"""The folds: state rebuilt from the event stream, the same live, on a recording and on a
simulation. Each reads events (``engine.events``) and nothing of the engine's state.

- ``view``: ``EngineView``, the whole state, for ``/debug/state``, ``/events`` and the dashboard
- ``startup_state``: the view's startup phases per rank, their ledger and the time left
- ``block_table``: block tables rebuilt from step events
- ``tally``: ``RunTally``, a run's totals, peaks and per-request times
- ``request_record``: ``RequestRecord``, one request's whole life, folded once (``RequestFold``) for every reader of request events; per-request metrics
- ``accounting``: every arrival finished once with a typed reason; aborts by cause, discarded prefill work
- ``kv_occupancy``: KV occupancy by token slots, filled against allocated per KV cache group
- ``block_residency``: KV block lifetimes, idle times and reuse gaps (the ``--kv-cache-metrics`` histograms)
- ``sessions``: a session's turns: the previous turn's blocks still resident, who evicted the rest
- ``run_diff``: a run's profile, and two profiles compared
- ``expert_load``: MoE expert counts over a window
- ``dp_balance``: data-parallel ranks' load over a run
- ``frozen_counters``: a stall seen from ``/metrics``: requests running, token counters frozen
- ``pipeline_idle``: pipeline stages' bubbles over a run
- ``parallel_window``: the last seconds of both, for the monitor
"""
