"""``engine demo``: what ``make demo`` runs. The bundled model (or ``--model``, e.g.
``gemma-3-270m`` with its sliding-window layers) served on a free
loopback port, a synthetic load of concurrent streaming clients, and the live
dashboard fed by the in-process bus (quit with ``q``).

The sizes are small on purpose (a KV pool of 2,912 tokens, --max-model-len 2048:
64 MiB in bf16, 128 MiB in the fp32 that AVX2-only CPUs run) so the pool fills, requests get preempted and prefix-cache hits show. When stdout is
not a terminal (CI, a pipe) it runs headless: ``--duration`` seconds of load from
the moment the server is ready, sized to the machine as it runs (a request is sent
only if the measured latencies say it finishes in time), then a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from engine.cli.dashboard import load_dashboard
from engine.cli.flags import add_workload_flags, bytes_type, workload_spec_from_args
from engine.cli.program import Subparsers
from engine.config import EngineConfig
from engine.errors import UserError
from engine.events import EventBus
from engine.logs import configure_logging
from engine.serve.settings import ServerSettings
from engine.sim.workload import SummaryCollector, TokenIds, VocabTokenIds, WorkloadRequest, generate_workload

if TYPE_CHECKING:
    import httpx

DEMO_MODEL = "smollm2-135m"
# 182 blocks of 16: enough for one 2,048-token request, small enough to preempt under the demo's load.
DEMO_POOL_TOKENS = 2912


DESCRIPTION = f"""What make demo runs: {DEMO_MODEL} served on a free loopback port, streaming
clients sending a synthetic load (random ordinary token ids, Poisson arrivals,
a shared prefix for prefix-cache hits) and the live dashboard fed by the
in-process bus (quit with q). The KV pool is small on purpose so it fills and
requests get preempted. Without a terminal it runs headless: --duration
seconds of load from ready, sized to the machine, then a summary."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="the bundled model serving a synthetic load, with the live dashboard",
                       description=DESCRIPTION)
    add_workload_flags(p, num_prompts=None, input_len="32:256", output_len="16:128", request_rate=3.0,
                       shared_prefix_fraction=0.4, shared_prefix_len=192,
                       num_prompts_help="requests the streaming clients send (default 80 with the dashboard, 40 headless)")
    p.add_argument("--kv-cache-memory-bytes", type=bytes_type("--kv-cache-memory-bytes"), default=None,
                   help=f"KV pool size in bytes, suffixes Ki/Mi/Gi allowed (default: {DEMO_POOL_TOKENS:,} tokens "
                        "in this CPU's dtype, small so preemptions show)")
    p.add_argument("--model", default=DEMO_MODEL, metavar="NAME",
                   help=f"the model to serve (default {DEMO_MODEL}; gemma-3-270m once make setup has assembled it)")
    p.add_argument("--duration", type=float, default=45.0,
                   help="headless: seconds of load after the server is ready (default 45); requests that would "
                        "not finish in time are not sent")
    p.add_argument("--headless", action="store_true", help="no dashboard, print a summary (default when not a tty)")
    p.add_argument("--threads", dest="num_threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: all cores)")
    p.set_defaults(func=run)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(model=args.model, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=1024,
                          stats_interval=5.0, num_threads=args.num_threads)
    if args.kv_cache_memory_bytes is not None:
        config.kv_cache_memory_bytes = args.kv_cache_memory_bytes
    else:
        config.kv_cache_memory_bytes = demo_pool_bytes(config)
    return config


def demo_pool_bytes(config: EngineConfig) -> int:
    """The default pool in bytes for :data:`DEMO_POOL_TOKENS` tokens in the dtype this
    machine runs (``--dtype auto`` is by ISA), so the demo behaves alike everywhere."""
    from engine.budget.memory import bytes_per_kv_token
    from engine.model.memory.device import resolve_device
    from engine.modelspec.readers import load_model_config
    from engine.startup.resolve import resolve_dtype

    model = load_model_config(config.model)
    dtype = resolve_dtype(config, model, resolve_device(config.device)).dtype
    return DEMO_POOL_TOKENS * bytes_per_kv_token(model, config.kv_cache_dtype, 1, dtype)


MAX_IN_FLIGHT = 16  # half of --max-num-seqs: the small pool still preempts, queues stay short
PROBE_IN_FLIGHT = 4  # headless: requests sent before the first measurements
DRAIN_GRACE_S = 30.0  # headless: how long past --duration the last streams may take before they are cut


class DemoLoad:
    """Streaming clients that send ``workload`` at its arrival times, prompts from
    ``token_ids``, at most ``max_in_flight`` at once; ``stop`` ends them (open streams
    are closed, which aborts their requests).

    With a ``duration`` (headless), the load is sized to this machine as it runs: a
    request is sent only if the TTFT and inter-token time measured on the open streams
    say it will finish by then, so the summary covers requests that completed
    rather than ones cut off."""

    def __init__(self, url: str, workload: list[WorkloadRequest], token_ids: TokenIds,
                 max_in_flight: int = MAX_IN_FLIGHT, duration: float | None = None, model: str = DEMO_MODEL) -> None:
        self.url = url + "/v1/completions"
        self.model = model  # the served model name the requests ask for
        self.workload = workload
        self.prompts = {req.request_id: token_ids.prompt(req) for req in workload}
        self.max_in_flight = max_in_flight
        self.duration = duration
        self.stop = threading.Event()
        self.done = threading.Event()
        self.sent = 0
        self.skipped = 0  # not sent: they would not have finished within the duration
        self.completed = 0
        self.in_flight = 0
        self.ttft_last: float | None = None  # measured on the streams, for headless sizing
        self.itl_recent: float | None = None
        self.gaps: collections.deque[float] = collections.deque(maxlen=256)
        self.started = time.monotonic()  # reset when run() begins: after the server is ready
        self.failed: list[str] = []

    def run(self) -> None:
        self.started = time.monotonic()
        try:
            asyncio.run(self._main())
        finally:
            self.done.set()

    def _fits(self, req: WorkloadRequest) -> bool:
        """Headless: will ``req`` finish by the end of the duration? Its estimate is the
        last measured TTFT plus its output tokens at the measured inter-token time,
        scaled for one more sequence in the batch. Until tokens have been measured,
        only a probe of PROBE_IN_FLIGHT requests goes out."""
        if self.duration is None:
            return True
        if self.itl_recent is None:
            return self.in_flight < PROBE_IN_FLIGHT
        crowding = (self.in_flight + 1) / max(self.in_flight, 1)
        estimate = (self.ttft_last or 0.0) + req.output_tokens * self.itl_recent * crowding
        return time.monotonic() + estimate <= self.started + self.duration

    def _observe(self, ttft: float | None, gap: float | None) -> None:
        if ttft is not None:
            self.ttft_last = ttft
        if gap is not None:  # the median of recent gaps: a preemption's stall is no trend
            self.gaps.append(gap)
            self.itl_recent = statistics.median(self.gaps)

    async def _main(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.max_in_flight + 4)
        slots = asyncio.Semaphore(self.max_in_flight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
            tasks = [asyncio.create_task(self._one(client, slots, req)) for req in self.workload]
            while not self.stop.is_set() and not all(t.done() for t in tasks):
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, slots: asyncio.Semaphore, req: WorkloadRequest) -> None:
        await asyncio.sleep(req.arrival_time)
        async with slots:
            while not self._fits(req):
                if self.itl_recent is not None:  # measured: it will not finish in time
                    self.skipped += 1
                    return
                await asyncio.sleep(0.2)  # wait for the probe's first measurements
            body: dict[str, Any] = {"model": self.model, "prompt": self.prompts[req.request_id],
                                    "max_tokens": req.output_tokens,
                                    "temperature": 0.8, "stream": True, "ignore_eos": True}
            self.sent += 1
            self.in_flight += 1
            try:
                await self._stream(client, body)
            finally:
                self.in_flight -= 1

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        sent_at = last = time.monotonic()
        first = True
        async with client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                self.failed.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.monotonic()
                self._observe(now - sent_at if first else None, None if first else now - last)
                first, last = False, now
        self.completed += 1


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.cli.commands.serve import make_server
    from engine.serve.host import EngineHost

    headless = args.headless or not sys.stdout.isatty()
    if args.num_prompts is None:
        args.num_prompts = 40 if headless else 80
    workload = generate_workload(workload_spec_from_args(args))  # bad workload flags fail before the server starts
    # No dashboard installed: a UserError before the engine starts.
    run_dashboard = None if headless else load_dashboard()
    if headless:
        configure_logging("json", level="warning")
    else:  # the dashboard owns the terminal
        configure_logging("json", level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115
    config = demo_config(args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    summary = SummaryCollector()
    bus = EventBus()
    bus.subscribe(summary)
    host = EngineHost.create(config, ServerSettings(served_model_name=config.model, shutdown_timeout_s=2.0), bus=bus)
    server: uvicorn.Server = make_server(host, "127.0.0.1", port)
    http_thread = threading.Thread(target=server.run, name="kvscope-http", daemon=True)
    holder: dict[str, DemoLoad] = {}

    def start_load() -> None:
        llm = host.engine.wait_ready()
        while not server.started and http_thread.is_alive():
            time.sleep(0.05)
        load = holder["load"] = DemoLoad(url, workload, VocabTokenIds.for_engine(llm, seed=args.workload_seed),
                                         duration=args.duration if headless else None, model=config.model)
        load.run()

    http_thread.start()
    load_thread = threading.Thread(target=start_load, name="kvscope-demo-load", daemon=True)
    load_thread.start()
    start = time.monotonic()
    try:
        if headless:
            print(f"engine demo: {config.model} on {url}, {args.num_prompts} streaming requests at "
                  f"{args.request_rate:g}/s (headless: {args.duration:g} s of load once ready)", flush=True)
            _wait_for_load(load_thread, holder, args.duration)
        elif run_dashboard is not None:
            run_dashboard(bus, host.view.snapshot, f"engine demo {url}")
    finally:
        if "load" in holder:
            holder["load"].stop.set()
        load_thread.join(timeout=15)
        host.begin_shutdown()
        server.should_exit = True
        http_thread.join(timeout=30)
    host.engine.wait_ready()  # a startup failure surfaces here as its one-line error
    load = holder.get("load")
    if load is None:
        raise UserError("the demo load never started (the server did not come up)")
    return _report(load, host.view.snapshot(), summary, args.num_prompts, start)


def _wait_for_load(load_thread: threading.Thread, holder: dict[str, DemoLoad], duration: float) -> None:
    """Headless: until the load ends, or ``duration`` after ready (startup's time is its own);
    streams still open ``DRAIN_GRACE_S`` after it are cut."""
    while load_thread.is_alive():
        load = holder.get("load")
        if load is not None and time.monotonic() - load.started > duration + DRAIN_GRACE_S:
            break
        load_thread.join(timeout=0.5)


def _report(load: DemoLoad, state: dict[str, Any], summary: SummaryCollector, num_prompts: int, start: float) -> int:
    """What the demo did, as ``vllm bench serve`` words it; 1 when a request failed."""
    not_sent = f" ({load.skipped} not sent: they would not have finished within --duration)" if load.skipped else ""
    print(f"ready after {load.started - start:.1f} s; sent {load.sent} of {num_prompts} requests{not_sent}, "
          f"{load.completed} completed in {time.monotonic() - load.started:.1f} s; "
          f"KV pool {state['kv']['total']} blocks, {state['preemptions']} preemptions")
    summary.summary.wall_s = time.monotonic() - load.started  # the load's time, not the startup's
    for line in summary.summary.lines():
        print(line)
    for failure in load.failed[:5]:
        print(f"failed: {failure}")
    return 1 if load.failed else 0
