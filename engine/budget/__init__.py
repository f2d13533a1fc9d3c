"""The memory budget: one formula (:mod:`~engine.budget.memory`: requested = total x
utilization; KV pool = requested - weights - activation peak - non-torch) used by startup,
``engine plan``, the simulator and logparse; model shapes, GPU and model presets, and the
engine's flags as a config (:mod:`~engine.budget.config`). The ledger table naming each
quantity (:mod:`engine.events.ledger`) and a step's FLOPs and bytes per GPU
(:mod:`engine.events.roofline`) live in the event wing below: the events carry those
quantities, and the budget reads the event records, never the other way round."""
