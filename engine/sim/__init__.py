"""Model-free executors of the same step loop and the workloads they run:
:mod:`~engine.sim.simulate` (a roofline cost model's seconds), :mod:`~engine.sim.replay`
(a recording's own stops, ``--verify``), :mod:`~engine.sim.driver` (fixed tokens, for
tests and ``engine bench-scheduler``); :mod:`~engine.sim.data_parallel` runs D ranks of
the cost model behind vLLM's balancer; :mod:`~engine.sim.workload` generates the
requests all of them (and the real engine's run-workload and demo) run."""
