"""The memory budget: one formula (:mod:`~engine.budget.memory`: requested = total x
utilization; KV pool = requested - weights - activation peak - non-torch) used by startup,
``engine plan``, the simulator and logparse; the one ledger table naming each quantity
(:mod:`~engine.budget.ledger`); model shapes, GPU and model presets, and the engine's
flags as a config (:mod:`~engine.budget.config`); a step's FLOPs and bytes per GPU
(:mod:`~engine.budget.roofline`), which the simulator's cost model and /metrics' MFU
estimates share."""
