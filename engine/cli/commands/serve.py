"""``engine serve [MODEL]``: the OpenAI-compatible server (see engine/serve/app.py).

The port is bound first (a busy port is refused at once), then startup runs,
then uvicorn starts answering on it: a client that sees /health answer 200 can
send requests at once; one that connects during startup waits in the backlog. ``--monitor`` shows the live dashboard in
this terminal, fed by the in-process bus, while uvicorn serves from a thread.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from engine.cli.exporters import add_exporter_flags, attach_exporters
from engine.cli.flags import add_engine_flags, engine_config_from_args, model_from_args
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.logs import configure_logging, get_logger
from engine.modelspec.presets import BUNDLED_MODEL_NAME
from engine.profiling import profile_dir
from engine.serve.settings import LOOPBACK_HOSTS, ServerSettings

if TYPE_CHECKING:  # the app and the engine load torch: only once the flags are checked
    from engine.config import EngineConfig
    from engine.events import EventBus
    from engine.serve.host import EngineHost
    from engine.serve.shared_folds import LockedLifecycle

API_KEY_ENV = "KVSCOPE_API_KEY"


def register(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API, /metrics and the live /events stream")
    add_engine_flags(p, positional_model=True)
    add_server_flags(p)
    add_exporter_flags(p)
    p.set_defaults(func=run)


class EnableDisable(argparse.Action):
    """vLLM's ``--enable-X`` / ``--disable-X`` pair as one argument (one destination)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, bool(option_string and option_string.startswith("--enable-")))


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's are EngineConfig's, engine/cli/flags.py): where it listens and who
    may call it, how it sheds load, shuts down and watches for stalls; then its connection timeouts and the
    vLLM serve flags it accepts, each an argument group of its own."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*, /events, /debug/* (or set {API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="answer 429 (with Retry-After) at once when N requests already wait for a first token")
    p.add_argument("--metrics-require-key", action="store_true", help="require the API key on /metrics too")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are aborted")
    p.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help='CORS: origins browser pages may call from, as vLLM\'s flag (a JSON list, e.g. \'["*"]\', '
                        "or comma-separated); default none (vLLM's default is [\"*\"])")
    p.add_argument("--monitor", action="store_true", help="show the live dashboard in this terminal")
    p.add_argument("--stall-timeout", dest="stall_timeout_s", type=_stall_timeout, default=None, metavar="S",
                   help="kvscope's: an engine core with requests that finishes no step for S seconds is stalled: "
                        "/health answers 503 engine_stalled naming the rank, an engine.stalled event is published "
                        "and a dump (stacks, last step, requests) is written beside the recording; 0 turns it off. "
                        "Default: derived from this machine's step times, max(30 s, 10 x the longest of the profile "
                        "run's worst-case step and every step run), so a long prefill never trips it")
    _add_timeout_flags(p)
    _add_vllm_serve_flags(p)


def _add_timeout_flags(p: argparse.ArgumentParser) -> None:
    """How long a client may hold a connection without sending a whole request."""
    timeouts = p.add_argument_group(
        "connection timeouts", "how long a client may hold a connection without giving the server a whole request; "
                               "past each bound the server answers 408 (in OpenAI's error shape) or just closes")
    timeouts.add_argument("--timeout-keep-alive", type=_seconds, default=5.0, metavar="S",
                          help="close a connection idle for S seconds between requests, or fresh and silent "
                               "(uvicorn's flag and default: 5)")
    timeouts.add_argument("--timeout-headers", type=_seconds, default=10.0, metavar="S",
                          help="a request's line and headers must be complete S seconds after its first byte, "
                               "else 408 and close (slow-header clients, slowloris; default 10)")
    timeouts.add_argument("--timeout-body-idle", type=_seconds, default=10.0, metavar="S",
                          help="408 and close when no byte of a request body arrives for S seconds (default 10)")
    timeouts.add_argument("--timeout-body", type=_seconds, default=30.0, metavar="S",
                          help="408 and close when a request body is not complete S seconds after its headers, "
                               "however steadily it trickles (default 30)")


def _add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    """``vllm serve``'s own flags, accepted so its command lines run unchanged (some only accepted)."""
    vllm = p.add_argument_group("vLLM serve flags", "accepted so a `vllm serve ...` command line runs unchanged")
    vllm.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="a Jinja chat template (a file, or the template itself) instead of the model's own")
    vllm.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="kvscope reads the tokenizer from the model file or folder; only the model itself is accepted")
    vllm.add_argument("--trust-remote-code", action="store_true",
                      help="accepted; changes nothing (kvscope runs no code from a model repository)")
    vllm.add_argument("--enable-log-requests", "--disable-log-requests", dest="log_requests", action=EnableDisable,
                      default=False, help="one 'Received request ...' line per request, as vLLM logs it "
                                          "(off by default, as in vLLM >= 0.10)")
    vllm.add_argument("--max-log-len", type=int, default=None, metavar="N",
                      help="prompt token ids shown per request line (default: all)")
    vllm.add_argument("--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="uvicorn's own log level; at info (the default) it prints vLLM's access lines, "
                           '127.0.0.1:PORT - "POST /v1/completions HTTP/1.1" 200')
    vllm.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access lines")
    vllm.add_argument("--kv-cache-metrics", action="store_true",
                      help="serve the KV block residency histograms (vllm:kv_block_lifetime_seconds, "
                           "_idle_before_evict_seconds, _reuse_gap_seconds) on /metrics, for every block")
    vllm.add_argument("--kv-cache-metrics-sample", type=_sample_rate, default=0.01, metavar="RATE",
                      help="vLLM's sampling rate of those histograms, in (0, 1]; accepted for compatibility: "
                           "kvscope folds them from the step events and records every block")
    vllm.add_argument("--enable-per-request-metrics", action="store_true",
                      help='as vLLM: a request with "include_metrics": true gets "metrics" in its answer '
                           "(time_to_first_token_ms, generation_time_ms, queue_time_ms, mean_itl_ms, "
                           "tokens_per_second; kvscope's preemptions, prefix tokens reused and peak blocks under "
                           '"kvscope"), from its events')
    vllm.add_argument("--enable-mfu-metrics", action="store_true",
                      help="accepted: kvscope always serves the MFU estimates (vllm:estimated_flops_per_gpu_total, "
                           "_read_bytes_, _write_bytes_), the cost model's work of each step")


def _sample_rate(text: str) -> float:
    """--kv-cache-metrics-sample as vLLM checks it (a rate in (0, 1])."""
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not 0 < rate <= 1:
        raise argparse.ArgumentTypeError(f"--kv-cache-metrics-sample {text!r}: must be a fraction in (0, 1], e.g. 0.01")
    return rate


def _stall_timeout(text: str) -> float:
    """--stall-timeout: seconds >= 0 (0: off)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--stall-timeout {text!r}: give seconds, e.g. 60, or 0 to turn the stall "
                                         "detector off")
    return value


def _seconds(text: str) -> float:
    """A timeout flag: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds, e.g. 10")
    return value


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: must be in 1..65535")
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0 seconds")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise UserError(f"--max-waiting-requests {args.max_waiting_requests}: must be at least 1")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.metrics_require_key and not api_key:
        raise UserError(f"--metrics-require-key needs an API key: pass --api-key or set {API_KEY_ENV}")
    model = model_from_args(args)
    name = args.served_model_name or (model if model else BUNDLED_MODEL_NAME)
    # Without a key, a loopback server answers only loopback Host names: a web page the
    # user visits cannot reach it by rebinding its own DNS name to 127.0.0.1.
    loopback = args.host in ("127.0.0.1", "localhost")  # (Starlette's host check cannot parse "[::1]:port")
    trusted = LOOPBACK_HOSTS if loopback and not api_key else None
    if args.max_log_len is not None and args.max_log_len < 0:
        raise UserError(f"--max-log-len {args.max_log_len}: must be >= 0")
    check_tokenizer_flag(args.tokenizer, model)
    return ServerSettings(served_model_name=name, api_key=api_key, metrics_require_key=args.metrics_require_key,
                          max_waiting_requests=args.max_waiting_requests, shutdown_timeout_s=args.shutdown_timeout,
                          allowed_origins=parse_allowed_origins(args.allowed_origins), trusted_hosts=trusted,
                          log_requests=args.log_requests, max_log_len=args.max_log_len,
                          chat_template=load_chat_template(args.chat_template),
                          kv_cache_metrics=args.kv_cache_metrics, timeout_keep_alive_s=args.timeout_keep_alive,
                          per_request_metrics=args.enable_per_request_metrics,
                          header_timeout_s=args.timeout_headers, body_idle_timeout_s=args.timeout_body_idle,
                          body_timeout_s=args.timeout_body,
                          profile_dir=profile_dir(getattr(args, "trace_out", None), getattr(args, "events_path", None)))


def check_tokenizer_flag(tokenizer: str | None, model: str) -> None:
    """vLLM's --tokenizer: kvscope's tokenizer is the model's own (GGUF metadata or the
    HF folder's files), so only a value naming the model itself is accepted."""
    if tokenizer is None:
        return
    same = tokenizer == model or (os.path.exists(tokenizer) and os.path.exists(model)
                                  and os.path.samefile(tokenizer, model))
    if not same:
        raise UserError(f"--tokenizer {tokenizer}: kvscope reads the tokenizer from the model ({model}); "
                        "leave --tokenizer out, or point --model at a folder that holds both")


def load_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's text, or the template given inline; compiled
    here so a broken template fails before startup."""
    if value is None:
        return None
    template = value
    if "{" not in value:
        try:
            template = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--chat-template {value}: cannot read it ({exc.strerror or exc}); "
                            "give a Jinja file or the template itself") from None
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"--chat-template: not a Jinja template (line {exc.lineno}: {exc.message})") from None
    return template


def parse_allowed_origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list of strings (vLLM's form) or comma-separated origins."""
    if value is None or not value.strip():
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--allowed-origins {value!r}: not a JSON list ({exc.msg}); "
                            'give e.g. \'["http://localhost:3000"]\' or a comma-separated list') from None
        if not isinstance(parsed, list) or not all(isinstance(o, str) and o for o in parsed):
            raise UserError(f"--allowed-origins {value!r}: the JSON must be a list of non-empty strings")
        return tuple(parsed)
    return tuple(o.strip() for o in text.split(",") if o.strip())


class KvscopeServer(uvicorn.Server):
    """uvicorn, plus: on SIGINT/SIGTERM stop taking requests and end /events
    streams at once, so the graceful wait is only for real requests; when
    ``--shutdown-timeout`` runs out, abort what is left in the engine so every
    stream still ends properly (finish_reason "abort", then ``[DONE]``).

    When the engine thread dies after startup, the server stops the same way and
    ``engine_failure`` holds the cause: a process that can no longer answer a
    request exits 1, so its supervisor restarts it (a server left up would answer
    503 for good)."""

    def __init__(self, config: uvicorn.Config, host: EngineHost) -> None:
        super().__init__(config)
        self.kvscope_host = host
        self.engine_failure: BaseException | None = None
        self.started_engine = False  # startup has ended (well or not): announced, or the server stops

    async def on_tick(self, counter: int) -> bool:
        if not self.started_engine:
            self._watch_startup()
        error = self.kvscope_host.engine.error
        if error is not None and self.engine_failure is None:
            self.engine_failure = error
            get_logger("kvscope.serve").error(f"the engine thread stopped ({engine_failure_reason(error)}); "
                                              "stopping the server, exit status 1")
            self.kvscope_host.begin_shutdown()
            self.should_exit = True
        return await super().on_tick(counter)

    def _watch_startup(self) -> None:
        """Once startup ends: say where the engine serves, or stop the server (a failed
        startup is re-raised by the caller: exit 2)."""
        from engine.serve.startup_health import FAILED, READY, engine_state

        state, _ = engine_state(self.kvscope_host.engine)
        if state == READY:
            get_logger("kvscope.serve").info(
                f"serving {self.kvscope_host.settings.served_model_name} on http://{self.config.host}:"
                f"{self.config.port} (OpenAI API under /v1, metrics /metrics, events /events)")
        elif state == FAILED:
            self.should_exit = True
        self.started_engine = state != "starting"

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            self.kvscope_host.begin_shutdown()
            timer = threading.Timer(self.kvscope_host.settings.shutdown_timeout_s, self.kvscope_host.engine.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # uvicorn re-raises a caught SIGTERM after shutdown (exit -15); a stop
        # that drained and flushed everything is a success: exit 0.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def engine_failure_reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def bind_listening_socket(bind: str, port: int) -> socket.socket:
    """Bind and listen before anything slow runs, so a busy port is refused at once
    (not after the weights and the profile run); uvicorn then serves on this socket."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    try:
        sock.bind((bind, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"--host {bind} --port {port}: cannot listen there ({exc.strerror or exc}); "
                        "pick another --port or stop the process that holds it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(host: EngineHost, bind: str, port: int, log_level: str = "warning",
                access_log: bool = False) -> KvscopeServer:
    from engine.serve.app import build_app
    from engine.serve.http_limits import protocol_with_header_timeout

    settings = host.settings
    config = uvicorn.Config(build_app(host), host=bind, port=port, log_level=log_level, access_log=access_log,
                            # a backstop: the abort timer in handle_exit normally ends every stream first
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
                            lifespan="on",
                            # h11 pinned (not httptools when installed): the header deadline lives in its protocol
                            http=protocol_with_header_timeout(settings.header_timeout_s),
                            timeout_keep_alive=settings.timeout_keep_alive_s)  # type: ignore[arg-type]
    return KvscopeServer(config, host)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    config = engine_config_from_args(args)
    if (config.pipeline_parallel_size or 1) > 1:
        from engine.pipeline import Rendezvous
        from engine.workers import run_node

        if Rendezvous.of(config).node_rank > 0:  # a host beyond 0 serves nothing: it runs its stages (headless)
            configure_logging(args.log_format)
            return run_node(config)
    from engine.events import EventBus
    from engine.serve.shared_folds import LockedLifecycle

    bus = EventBus()
    # /debug/requests' fold, which the span and trace exporters read too (one fold of each event)
    lifecycle = LockedLifecycle()
    exporters = attach_exporters(args, bus, lifecycle)  # a bad exporter flag is refused before the port is bound
    try:
        return (_run_with_monitor(args, settings, bus, lifecycle) if args.monitor
                else _serve(args, settings, config, bus, lifecycle))
    finally:
        exporters.close()  # the trace file is written, queued spans are sent


def _serve(args: argparse.Namespace, settings: ServerSettings, config: EngineConfig, bus: EventBus,
           lifecycle: LockedLifecycle) -> int:
    configure_logging(args.log_format)
    log = get_logger("kvscope.serve")
    listener = bind_listening_socket(args.host, args.port)
    from engine.serve.host import EngineHost

    host = EngineHost.create(config, settings, bus=bus, lifecycle=lifecycle)
    if settings.chat_template is not None:  # the chat route renders with it (also under --monitor)
        log.info("chat template from --chat-template replaces the model's own")
    if args.trust_remote_code:
        log.info("--trust-remote-code changes nothing: kvscope runs no code from a model repository")
    server = make_server(host, args.host, args.port, log_level=args.uvicorn_log_level,
                         access_log=not args.disable_uvicorn_access_log)
    server.run(sockets=[listener])  # /health answers 503 with the phase and the ETA until the engine is ready
    from engine.serve.startup_health import STARTING, engine_state

    state, startup_failure = engine_state(host.engine)
    if startup_failure is not None:
        raise startup_failure  # a startup UserError exits 2 here; no request reached the engine
    if state == STARTING:
        log.info("server stopped during startup")
        return 0
    if server.engine_failure is not None:
        log.error(f"server stopped: the engine thread died ({engine_failure_reason(server.engine_failure)}); "
                  "exit status 1 so a supervisor restarts it")
        return 1
    log.info("server stopped; event log flushed")
    return 0


def _run_with_monitor(args: argparse.Namespace, settings: ServerSettings, bus: EventBus | None = None,
                      lifecycle: LockedLifecycle | None = None) -> int:
    """Dashboard in the main thread (it owns the terminal), uvicorn in a thread;
    the dashboard subscribes to the bus before startup so phases A–G show live."""
    from engine.cli.dashboard import load_dashboard
    from engine.events import EventBus
    from engine.serve.host import EngineHost

    run_dashboard = load_dashboard()  # no dashboard installed: a UserError before anything binds
    listener = bind_listening_socket(args.host, args.port)
    configure_logging("json", level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115
    host = EngineHost.create(engine_config_from_args(args), settings, bus=bus or EventBus(), lifecycle=lifecycle)
    # The view subscribed before startup: its snapshot holds every phase so far.
    server = make_server(host, args.host, args.port)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="kvscope-http", daemon=True)
    thread.start()
    run_dashboard(host.bus, host.view.snapshot, f"serve http://{args.host}:{args.port}")
    host.begin_shutdown()
    server.should_exit = True
    thread.join(timeout=settings.shutdown_timeout_s + 30)
    host.engine.wait_ready()  # re-raises a startup failure the dashboard showed
    # The HTTP server stopped itself when the engine died (its on_tick), and the dashboard
    # ended on the engine.stopped event the engine thread published; this exits 1.
    failure = server.engine_failure or host.engine.error
    if failure is not None:
        print(f"engine serve: the engine thread died ({engine_failure_reason(failure)}); exit status 1",
              file=sys.stderr)
        return 1
    return 0
