"""Startup in phases A–G, each measured and emitted as ``startup.phase`` events; a module per phase group.

- ``phases``: ``start_engine``: phases A–G in order, each inside its ``startup.phase`` events; ``StartupResult``
- ``recorder``: each phase's begin/end events with the memory around it; ``startup.progress`` callbacks
- ``resolve``: the flags with every ``auto`` filled in and why (dtype, KV cache dtype, quantization, CPU budget)
- ``inputs``: before phase A: the device, the model, the resolved flags and KV cache groups (``prepare_startup``)
- ``device_budget``: phase A (versions, the first memory reading, CPU kernel builds) and phase B (the budget)
- ``weights``: phase C: the runner, its weights, the CPU kernel plan over them, the tokenizer
- ``profile_run``: phase D: the worst-case step's activation peak, measured or read back
- ``kv_pool``: phase E: the KV cache pool from the budget formula, capped, agreed across ranks, allocated
- ``warmup``: phase F: CUDA graphs, or the CPU kernels, ``--compile`` and every step shape warmed
"""
