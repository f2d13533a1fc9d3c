"""Serving: :mod:`~engine.serve.app` (``build_app``: assembles the FastAPI app from the
routers, middleware and OpenAI-shaped error handlers), :mod:`~engine.serve.routes_openai`
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``),
:mod:`~engine.serve.routes_observability` (``/health``, ``/metrics``, ``/debug/state``,
``/events``), :mod:`~engine.serve.route_support` (what the routes share: the host behind
a request, the API-key checks, error responses, SSE streaming),
:mod:`~engine.serve.host` (the server settings, the bus subscribers and the engine host),
:mod:`~engine.serve.http_limits` (the header deadline, keep-alive and body size and time bounds),
:mod:`~engine.serve.async_engine` (the engine thread behind it) and
:mod:`~engine.serve.protocol` (the OpenAI request and response types)."""
