"""``engine run-workload``: a synthetic workload through the real engine,
recorded for the monitor and for replay (``--events run.jsonl``), optionally
with the live dashboard in the same terminal (``--monitor``)."""

from __future__ import annotations

import argparse
import os
import threading

from engine.cli.flags import add_engine_flags, engine_config_from_args
from engine.events import EventBus
from engine.llm_engine import LLMEngine
from engine.logs import configure_logging
from engine.sim.workload import (
    WorkloadSummary,
    drive_workload,
    make_workload,
    ordinary_token_ids,
    parse_range,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-workload", help="run a synthetic workload through the real engine and record it")
    add_engine_flags(p, positional_model=True)
    add_workload_flags(p)
    p.add_argument("--monitor", action="store_true", help="show the live dashboard in this terminal")
    p.set_defaults(func=run)


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="64:256", metavar="A:B")
    p.add_argument("--output-len", default="32:128", metavar="A:B")
    p.add_argument("--rate", type=float, default=float("inf"), help="requests per second (default: all at once)")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=0)


def build_workload(args: argparse.Namespace, engine: LLMEngine) -> list:
    tok = engine.tokenizer
    vocab = ordinary_token_ids(engine.startup.model_config.vocab_size, set(getattr(tok, "special_token_ids", set())))
    return make_workload(args.num_requests, parse_range(args.prompt_len, "--prompt-len"),
                         parse_range(args.output_len, "--output-len"), vocab, rate=args.rate,
                         seed=args.workload_seed, shared_prefix_fraction=args.shared_prefix_fraction,
                         shared_prefix_len=args.shared_prefix_len)


def run_with_monitor(args: argparse.Namespace, title: str) -> WorkloadSummary | None:
    """Engine on a worker thread, dashboard in the main thread; the monitor
    subscribes before startup so it shows phases A–G as they happen."""
    from engine.cli.dashboard import load_dashboard

    run_dashboard = load_dashboard()  # no dashboard installed: a UserError before the engine starts
    config = engine_config_from_args(args)
    bus = EventBus()
    result: dict[str, object] = {}
    stop = threading.Event()

    def work() -> None:
        try:
            with LLMEngine(config, bus=bus) as engine:
                result["summary"] = drive_workload(engine, build_workload(args, engine), realtime=True,
                                                   should_stop=stop.is_set)
        except Exception as exc:  # shown after the dashboard closes
            result["error"] = exc

    worker = threading.Thread(target=work, name="kvscope-engine", daemon=True)
    worker.start()
    # No snapshot_fn (there is no view here): the dashboard folds the bus from when it mounts.
    run_dashboard(bus, None, title)
    stop.set()
    worker.join(timeout=30)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    summary = result.get("summary")
    return summary if isinstance(summary, WorkloadSummary) else None


def run(args: argparse.Namespace) -> int:
    if args.monitor:
        # The dashboard owns the terminal; it shows the same facts as events.
        configure_logging("json", level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115
        summary = run_with_monitor(args, "run-workload")
    else:
        configure_logging(args.log_format)
        with LLMEngine(engine_config_from_args(args)) as engine:
            summary = drive_workload(engine, build_workload(args, engine), realtime=args.rate != float("inf"))
    if summary is not None:
        for line in summary.lines():
            print(line)
        if args.events_path:
            print(f"recorded to {args.events_path}: replay with `monitor replay {args.events_path}`")
    return 0
