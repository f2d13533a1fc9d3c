"""The memory budget: one formula (:mod:`~engine.budget.memory`: requested = total x
utilization; KV pool = requested - weights - activation peak - non-torch) used by startup,
``engine plan``, the simulator and logparse; GPU presets, the per-stage budget, and a fix as
data (:mod:`~engine.budget.fixes`). The engine's flags are declared in :mod:`engine.config`,
below every wing that reads them. The ledger table naming each
quantity (:mod:`engine.events.ledger`) and a step's FLOPs and bytes per GPU
(:mod:`engine.events.roofline`) live in the event wing below: the events carry those
quantities, and the budget reads the event records, never the other way round."""
