"""Serving: :mod:`~engine.serve.app` (the FastAPI app: OpenAI routes, /metrics,
/debug/state, /events), :mod:`~engine.serve.async_engine` (the engine thread behind
it) and :mod:`~engine.serve.protocol` (the OpenAI request and response types)."""
