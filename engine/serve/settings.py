"""What the server is told on its command line (``ServerSettings``), in a module that
loads no torch, so ``engine serve --help`` and flag errors answer at once."""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(slots=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    metrics_require_key: bool = False
    max_waiting_requests: int | None = None
    shutdown_timeout_s: float = 10.0
    # CORS: origins a browser page may call from (vLLM's --allowed-origins; empty: no CORS headers).
    allowed_origins: tuple[str, ...] = ()
    # Host headers answered (None: any). A loopback server without an API key answers only
    # loopback names, so a web page cannot reach it through DNS rebinding.
    trusted_hosts: tuple[str, ...] | None = None
    max_body_bytes: int | None = None  # None: derived from --max-model-len once the engine is up
    log_requests: bool = False  # vLLM's --enable-log-requests: one line per request received
    max_log_len: int | None = None  # prompt token ids such a line shows (None: all)
    chat_template: str | None = None  # --chat-template: replaces the model's own
    kv_cache_metrics: bool = False  # vLLM's --kv-cache-metrics: the block residency histograms on /metrics
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics: include_metrics answers "metrics"
    profile_dir: str | None = None  # where /stop_profile writes the torch trace (engine/profiling.py)
    # How long a client may hold a connection without giving the server a whole request
    # (engine/serve/http_limits.py): idle with no request, a request's line and headers
    # from its first byte, no body byte, the whole body from the end of the headers.
    timeout_keep_alive_s: float = 5.0  # vLLM's --timeout-keep-alive (uvicorn's default)
    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
