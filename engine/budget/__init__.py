"""The memory budget: one formula (``memory``: requested = total x utilization; KV pool =
requested - weights - activation peak - non-torch) used by startup, ``engine plan``, the
simulator and logparse. The engine's flags are declared in ``engine.config``, below every wing
that reads them; the ledger naming each quantity (``engine.events.ledger``) and a step's FLOPs
and bytes (``engine.events.roofline``) live in the event wing below: the events carry those
quantities, and the budget reads the event records, never the other way round.

- ``memory``: the one memory formula (``plan_memory``), hybrid layouts included
- ``stages``: a pipeline replica's budget stage by stage
- ``vision``: a vision-language model's tower, items and encoder budget
- ``fixes``: ``Fix``, a fix as data, and a refusal's fixes
"""
