"""kvscope's engine, a wing per concept; every import arrow runs one way (tests/test_import_rules.py).

- ``core``: the pure core: scheduler, KV cache manager and coordinator, the step loop (no torch, no clock)
- ``events``: typed event records, the bus, the folds of them and every output made from them
- ``budget``: the one memory formula, pipeline stages, vision budgets, fixes as data
- ``modelspec``: what a model is, without torch: shapes, families, presets, readers
- ``model``: everything that touches tensors: families, attention, kernels, runner, sampler
- ``serve``: the OpenAI- and vLLM-compatible server
- ``sim``: model-free executors: simulate, replay, the driver, capacity
- ``cli``: the ``engine`` command and its subcommands
- ``config``: ``EngineConfig``, every engine flag declared once
- ``startup``: phases A–G, a module per phase group, ``start_engine`` in ``startup.phases``
- ``startup_eta``: a start's prediction of itself from this machine's earlier starts
- ``llm_engine``: ``LLMEngine``: startup, then the step loop's model executor
- ``detokenizers``: each unfinished request's incremental detokeniser (text, stop strings, the held tail)
- ``prompt_logprobs``: prompt logprobs gathered chunk by chunk until a request's first output
- ``llm``: the offline API (``LLM.generate`` / ``LLM.chat``)
- ``pipeline``: pipeline-parallel stages, micro-batches, activations between stages
- ``workers``: tensor-parallel ranks and this host's pipeline stages as processes
- ``dp_core``: one data-parallel engine core in its own process
- ``heartbeat``: each engine core's step heartbeat: the step under way, its phase, the queue
- ``stacks``: every thread's Python stack, of this process or of a data-parallel core
- ``profiling``: the torch profiler around steps (``/start_profile``, ``/stop_profile``)
- ``logs``: structlog in vLLM's line format, or JSON lines
- ``errors``: ``UserError``: one line, exit 2, no traceback
- ``gc_policy``: garbage collection deferred until phase G
"""
