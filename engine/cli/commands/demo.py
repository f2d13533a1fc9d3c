"""``engine demo``: what ``make demo`` runs. The bundled model served on a free
loopback port, a synthetic load of concurrent streaming clients, and the live
dashboard fed by the in-process bus (quit with ``q``).

The sizes are small on purpose (a KV pool of 2,912 tokens, --max-model-len 2048:
64 MiB in bf16, 128 MiB in the fp32 that AVX2-only CPUs run) so the pool fills, requests get preempted and prefix-cache hits show. When stdout is
not a terminal (CI, a pipe) it runs headless for at most ``--duration`` seconds
and prints a summary instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
from typing import Any

import httpx

from engine.budget.config import EngineConfig
from engine.cli.dashboard import load_dashboard
from engine.cli.flags import add_workload_flags, bytes_type, workload_spec_from_args
from engine.errors import UserError
from engine.events import EventBus
from engine.logs import configure_logging
from engine.serve.app import EngineHost, ServerSettings
from engine.sim.workload import SummaryCollector, TokenIds, VocabTokenIds, WorkloadRequest, generate_workload

DEMO_MODEL = "smollm2-135m"
# 182 blocks of 16: enough for one 2,048-token request, small enough to preempt under the demo's load.
DEMO_POOL_TOKENS = 2912


DESCRIPTION = f"""What make demo runs: {DEMO_MODEL} served on a free loopback port, streaming
clients sending a synthetic load (random ordinary token ids, Poisson arrivals,
a shared prefix for prefix-cache hits) and the live dashboard fed by the
in-process bus (quit with q). The KV pool is small on purpose so it fills and
requests get preempted. Without a terminal it runs headless for at most
--duration seconds and prints a summary."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the bundled model serving a synthetic load, with the live dashboard",
                       description=DESCRIPTION)
    add_workload_flags(p, num_prompts=None, input_len="32:256", output_len="16:128", request_rate=3.0,
                       shared_prefix_fraction=0.4, shared_prefix_len=192,
                       num_prompts_help="requests the streaming clients send (default 80 with the dashboard, 40 headless)")
    p.add_argument("--kv-cache-memory-bytes", type=bytes_type("--kv-cache-memory-bytes"), default=None,
                   help=f"KV pool size in bytes, suffixes Ki/Mi/Gi allowed (default: {DEMO_POOL_TOKENS:,} tokens "
                        "in this CPU's dtype, small so preemptions show)")
    p.add_argument("--duration", type=float, default=45.0, help="headless: stop after this many seconds (default 45)")
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
    config = EngineConfig(model=DEMO_MODEL, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=1024,
                          stats_interval=5.0, num_threads=args.num_threads)
    if args.kv_cache_memory_bytes is not None:
        config.kv_cache_memory_bytes = args.kv_cache_memory_bytes
    else:
        config.kv_cache_memory_bytes = demo_pool_bytes(config)
    return config


def demo_pool_bytes(config: EngineConfig) -> int:
    """The default pool in bytes for :data:`DEMO_POOL_TOKENS` tokens in the dtype this
    machine runs (``--dtype auto`` is by ISA), so the demo behaves alike everywhere."""
    from engine.budget.config import load_model_config
    from engine.budget.memory import bytes_per_kv_token
    from engine.model.device import resolve_device
    from engine.startup import resolve_dtype

    model = load_model_config(config.model)
    dtype = resolve_dtype(config, model, resolve_device(config.device)).dtype
    return DEMO_POOL_TOKENS * bytes_per_kv_token(model, config.kv_cache_dtype, 1, dtype)


class DemoLoad:
    """Streaming clients that send ``workload`` at its arrival times, prompts from
    ``token_ids``; ``stop`` ends them (open streams are closed, which aborts their requests)."""

    def __init__(self, url: str, workload: list[WorkloadRequest], token_ids: TokenIds) -> None:
        self.url = url + "/v1/completions"
        self.workload = workload
        self.prompts = {req.request_id: token_ids.prompt(req) for req in workload}
        self.stop = threading.Event()
        self.done = threading.Event()
        self.sent = 0
        self.started = time.monotonic()
        self.failed: list[str] = []

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.done.set()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=len(self.workload) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
            tasks = [asyncio.create_task(self._one(client, req)) for req in self.workload]
            while not self.stop.is_set() and not all(t.done() for t in tasks):
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, client: httpx.AsyncClient, req: WorkloadRequest) -> None:
        await asyncio.sleep(req.arrival_time)
        body: dict[str, Any] = {"model": DEMO_MODEL, "prompt": self.prompts[req.request_id],
                                "max_tokens": req.output_tokens,
                                "temperature": 0.8, "stream": True, "ignore_eos": True}
        self.sent += 1
        async with client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                self.failed.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for _ in response.aiter_lines():
                pass


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.cli.commands.serve import make_server

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
    host = EngineHost.create(config, ServerSettings(served_model_name=DEMO_MODEL, shutdown_timeout_s=2.0), bus=bus)
    server: uvicorn.Server = make_server(host, "127.0.0.1", port)
    http_thread = threading.Thread(target=server.run, name="kvscope-http", daemon=True)
    holder: dict[str, DemoLoad] = {}

    def start_load() -> None:
        llm = host.engine.wait_ready()
        while not server.started and http_thread.is_alive():
            time.sleep(0.05)
        load = holder["load"] = DemoLoad(url, workload, VocabTokenIds.for_engine(llm, seed=args.workload_seed))
        load.run()

    http_thread.start()
    load_thread = threading.Thread(target=start_load, name="kvscope-demo-load", daemon=True)
    load_thread.start()
    start = time.monotonic()
    try:
        if headless:
            print(f"engine demo: {DEMO_MODEL} on {url}, {args.num_prompts} streaming requests at "
                  f"{args.request_rate:g}/s (headless: at most {args.duration:g} s)", flush=True)
            while load_thread.is_alive() and time.monotonic() - start < args.duration:
                load_thread.join(timeout=0.5)
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
    state = host.view.snapshot()
    print(f"sent {load.sent} of {args.num_prompts} requests in {time.monotonic() - start:.1f} s; "
          f"KV pool {state['kv']['total']} blocks, {state['preemptions']} preemptions")
    summary.summary.wall_s = time.monotonic() - load.started  # the load's time, not the startup's
    for line in summary.summary.lines():
        print(line)
    for failure in load.failed[:5]:
        print(f"failed: {failure}")
    return 1 if load.failed else 0
