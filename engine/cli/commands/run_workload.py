"""``engine run-workload``: a synthetic workload through the real engine,
recorded for the monitor and for replay (``--events run.jsonl``), optionally
with the live dashboard in the same terminal (``--monitor``)."""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cli.exporters import add_exporter_flags, attach_exporters
from engine.cli.flags import (
    add_engine_flags,
    add_workload_flags,
    engine_config_from_args,
    workload_spec_from_args,
)
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.events import EngineConfigEvent, Event, EventBus, RequestArrived, RequestFinished
from engine.logs import configure_logging
from engine.sim.workload import (
    VocabTokenIds,
    WorkloadRequest,
    WorkloadSummary,
    drive_workload,
    generate_workload,
)

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

DESCRIPTION = """Run a synthetic workload through the real engine: prompts of random ordinary
token ids (no special tokens), each generating exactly its output length (greedy,
EOS ignored), sent at Poisson arrivals in seconds or all at once. Record it with
--events run.jsonl for the monitor and replay; --monitor shows the live dashboard."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser("run-workload", help="run a synthetic workload through the real engine and record it",
                       description=DESCRIPTION)
    add_engine_flags(p, positional_model=True)
    add_workload_flags(p, num_prompts=32, input_len="64:256", output_len="32:128", request_rate=float("inf"),
                       shared_prefix_len=256)
    p.add_argument("--monitor", action="store_true", help="show the live dashboard in this terminal")
    p.add_argument("--result-json", metavar="PATH",
                   help="write the run as vllm bench serve --save-result does (its keys, per-request lists and "
                        "ttft/tpot/itl statistics in ms), from the run's request events")
    add_exporter_flags(p)
    p.set_defaults(func=run)


def run_workload(args: argparse.Namespace, engine: LLMEngine, workload: list[WorkloadRequest], realtime: bool,
                 should_stop: object = None) -> WorkloadSummary:
    """Drive ``workload`` through ``engine``, its prompts drawn from the engine
    tokenizer's ordinary vocabulary with the workload's seed."""
    ids = VocabTokenIds.for_engine(engine, seed=args.workload_seed)
    return drive_workload(engine, workload, ids, realtime=realtime, should_stop=should_stop)


def run_with_monitor(args: argparse.Namespace, workload: list[WorkloadRequest], title: str,
                     bus: EventBus | None = None) -> WorkloadSummary | None:
    """Engine on a worker thread, dashboard in the main thread; the monitor
    subscribes before startup so it shows phases A–G as they happen."""
    from engine.cli.dashboard import load_dashboard

    run_dashboard = load_dashboard()  # no dashboard installed: a UserError before the engine starts
    config = engine_config_from_args(args)
    bus = bus or EventBus()
    result: dict[str, object] = {}
    stop = threading.Event()

    def work() -> None:
        from engine.llm_engine import LLMEngine

        try:
            with LLMEngine(config, bus=bus) as engine:
                result["summary"] = run_workload(args, engine, workload, realtime=True,
                                                 should_stop=stop.is_set)
        except Exception as exc:  # shown after the dashboard closes
            result["error"] = exc

    worker = threading.Thread(target=work, name="kvscope-engine", daemon=True)
    worker.start()
    # No snapshot_fn (there is no view here): the dashboard folds the bus from when it mounts.
    run_dashboard(bus, None, title)
    stop.set()
    worker.join(timeout=30)
    error = result.get("error")
    if isinstance(error, BaseException):
        raise error
    summary = result.get("summary")
    return summary if isinstance(summary, WorkloadSummary) else None


def run(args: argparse.Namespace) -> int:
    workload = generate_workload(workload_spec_from_args(args))  # bad workload flags fail before the engine starts
    bus = EventBus()
    exporters = attach_exporters(args, bus)  # and bad exporter flags too
    request_events: list[Event] = []
    if args.result_json:
        if not Path(args.result_json).resolve().parent.is_dir():
            raise UserError(f"--result-json {args.result_json}: its folder does not exist; create it or name another")

        def keep(event: Event) -> None:  # what the result JSON is folded from
            if isinstance(event, EngineConfigEvent | RequestArrived | RequestFinished):
                request_events.append(event)

        bus.subscribe(keep)
    try:
        summary = _run(args, workload, bus)
    finally:
        exporters.close()
    if args.result_json:
        write_result_json(args, request_events)
    if summary is not None:
        for line in summary.lines():
            print(line)
        if args.events_path:
            print(f"recorded to {args.events_path}: replay with `monitor replay {args.events_path}`")
    for line in exporters.summary:
        print(line)
    return 0


def write_result_json(args: argparse.Namespace, events: list[Event]) -> None:
    from engine.events.exporters.bench_outputs import serve_result

    result = serve_result(events, backend="kvscope-offline",
                          num_prompts=args.num_prompts, request_rate=args.request_rate)
    Path(args.result_json).write_text(json.dumps(result) + "\n", encoding="utf-8")
    print(f"wrote {args.result_json} (vllm bench serve's result JSON: {result['completed']} completed, "
          f"mean TTFT {result['mean_ttft_ms']:.0f} ms)")


def _run(args: argparse.Namespace, workload: list[WorkloadRequest], bus: EventBus) -> WorkloadSummary | None:
    if args.monitor:
        # The dashboard owns the terminal; it shows the same facts as events.
        configure_logging("json", level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115
        return run_with_monitor(args, workload, "run-workload", bus)
    configure_logging(args.log_format)
    from engine.llm_engine import LLMEngine  # torch loads only once the flags are checked

    with LLMEngine(engine_config_from_args(args), bus=bus) as engine:
        return run_workload(args, engine, workload, realtime=args.request_rate != float("inf"))
