"""Model-free executors of the same step loop and the workloads they run.

- ``simulate``: the roofline cost model's executor, sweeps
- ``data_parallel``: D simulated ranks behind vLLM's balancer
- ``replay``: a recording re-run and verified
- ``driver``: fixed tokens, for tests and ``engine bench-scheduler``
- ``workload``: the one request generator and its traces
- ``capacity``: ``engine capacity``: the SLO, the run fold, the rate search, the binding constraint
- ``capacity_setup``: this machine or a GPU preset as a setup; the fixes tried
- ``step_fit``: this machine's per-step cost fitted to a recording
- ``traces``: a capacity trace, its format told, arrivals drawn where missing
- ``trace_recording``, ``trace_bench_serve``, ``trace_aiperf``, ``trace_mooncake``, ``trace_vllm_log``: one reader per trace format
"""
