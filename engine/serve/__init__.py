"""Serving: the OpenAI- and vLLM-compatible server over one engine host (or D data-parallel cores).

- ``app``: ``build_app``: routers, middleware, OpenAI-shaped error handlers
- ``routes_openai``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
- ``routes_observability``: ``/health``, ``/metrics``, ``/debug/*``, ``/events``
- ``routes_vllm``: vLLM's own routes
- ``kv_cache_info``: ``GET /v1/server/kv-cache``: the KV cache in force as vLLM's ``KVCacheRuntimeInfo``
- ``route_support``: what routes share: the host, API keys, SSE, errors
- ``protocol``: OpenAI's wire format as pydantic models
- ``logprobs``: logprobs in OpenAI's two shapes
- ``http_limits``: time and size bounds per connection and request
- ``async_engine``: the engine thread and its command queue
- ``host``: the engine side with no HTTP: subscribers, the ``/events`` hub
- ``shared_folds``: the view and the request fold the routes read and the exporters share (each event folded once)
- ``startup_health``: ``/health`` during startup (the phase, the ETA); requests held until ready
- ``data_parallel``: D engine cores behind one server
- ``stall``: the stall detector: a core with work and no step within the limit
- ``stall_dump``: a stalled core's dump: stacks, last step, requests and blocks
- ``settings``: the server's settings, no torch
"""
