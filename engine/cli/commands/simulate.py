"""engine simulate: the real scheduler and KV cache manager on a simulated GPU.

A roofline cost model replaces the forward pass: a step takes
max(bytes read / (bandwidth x efficiency), FLOPs / (peak x efficiency)), where
bytes = weights + the KV of every scheduled request's context and FLOPs =
2 x parameters x tokens. The run publishes the real engine's events (startup
phases marked simulated), so --events files open in the monitor and replay.

Examples:
  engine simulate --num-prompts 60 --random-input-len 500:3000 --random-output-len 150:400
  engine simulate --arrival poisson --request-rate 2 --arrival-unit s --num-prompts 500
  engine simulate --sweep max-num-batched-tokens=1024,2048,4096,8192,16384
  engine simulate --sweep concurrency=1,2,4,8,16,32,64,128,256 --plot saturation.png
  engine simulate --model llama-3.1-70b --pipeline-parallel-size 2 --data-parallel-size 2 --request-rate 4 --arrival-unit s

Parallel layouts (issue 37): --pipeline-parallel-size P plans each stage's GPU as
`engine plan -pp P` does and runs each step through the stages with
--pipeline-micro-batches micro-batches (step events carry each stage's bubble and bytes);
--data-parallel-size D runs D such replicas behind vLLM's load balancer (least
4 x waiting + running), their events stamped with dp_rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from engine.budget.memory import GPU_PRESETS
from engine.budget.stages import DEFAULT_MICRO_BATCHES, fill_drain_bubble, stage_lines
from engine.cli.exporters import add_exporter_flags, exporter_flags
from engine.cli.flags import (
    add_budget_flags,
    add_kv_events_flag,
    add_model_flags,
    add_multimodal_flags,
    add_scheduler_flags,
    add_workload_flags,
    engine_config_from_args,
    multimodal_flags,
    workload_spec_from_args,
)
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.events import EventBus
from engine.events.exporters.observers import Observers, attach_observers
from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND
from engine.sim.data_parallel import DataParallelResult, DataParallelSimulation
from engine.sim.simulate import (
    DEFAULT_EFFICIENCY,
    DEFAULT_GPU,
    DEFAULT_MODEL,
    DEFAULT_PIPELINE_LINK_GBS,
    SimResult,
    SimSetup,
    Simulation,
    build_setup,
    concurrency_crossover_tokens,
    concurrency_sweep,
    long_prompt_sweep,
)
from engine.sim.workload import WorkloadRequest, generate_workload, load_trace, parse_range, with_mm_items

SWEEPS = ("max-num-batched-tokens", "concurrency")


def register(sub: Subparsers) -> None:
    p = sub.add_parser("simulate", help="simulate serving at GPU scale: real scheduler, roofline cost model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, default_model=DEFAULT_MODEL)
    add_budget_flags(p)
    add_scheduler_flags(p)
    add_multimodal_flags(p)
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU preset: {', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})")
    p.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY,
                   help=f"fraction of peak bandwidth and FLOP/s the kernels reach (default {DEFAULT_EFFICIENCY:g})")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="D",
                   help="D replicas, each its own scheduler, KV pool and GPU(s), behind vLLM's DP load balancer")
    p.add_argument("--pipeline-micro-batches", type=int, default=DEFAULT_MICRO_BATCHES, metavar="M",
                   help=f"micro-batches in flight per step with --pipeline-parallel-size (default {DEFAULT_MICRO_BATCHES}, "
                        "kvscope's engine's)")
    p.add_argument("--pipeline-link-gbs", type=float, default=DEFAULT_PIPELINE_LINK_GBS, metavar="GB/S",
                   help=f"bandwidth between pipeline stages, GB/s (default {DEFAULT_PIPELINE_LINK_GBS:g}: one 400 Gb/s "
                        "NIC, stages on different nodes)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="fix the KV pool at N blocks instead of planning it")
    p.add_argument("--layer-pattern", default=None, metavar="SLIDING:FULL",
                   help="lay sliding-window layers over the model's: 5:1 = five sliding then one full, repeated "
                        "(Gemma 3), or one 'sliding'/'full' per layer, comma-separated; runs the hybrid KV cache manager")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="the sliding layers' window in tokens (with --layer-pattern; default: the model's)")
    add_workload_flags(p, num_prompts=60, input_len="500:3000", output_len="150:400", request_rate=0.0,
                       simulated=True)
    p.add_argument("--sweep", default=None, metavar="NAME=V1,V2,...",
                   help="max-num-batched-tokens=... (16,000-token prompt vs others' ITL) or concurrency=...")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the sweep into a PNG (throughput, TTFT and ITL against the swept value)")
    p.add_argument("--events", dest="events_path", default=None, metavar="PATH", help="record every event to JSONL")
    add_kv_events_flag(p)
    add_exporter_flags(p)
    p.add_argument("--stats-interval", type=float, default=10.0, help="simulated seconds between stats events (default 10)")
    p.add_argument("--json", action="store_true", help="print the summary (or sweep rows) as JSON")
    p.set_defaults(func=run)


def setup_from_args(args: argparse.Namespace) -> SimSetup:
    if args.model is None:
        args.model = DEFAULT_MODEL
    if args.data_parallel_size is not None and args.data_parallel_size < 1:
        raise UserError(f"--data-parallel-size {args.data_parallel_size}: give 1 or more replicas")
    engine = engine_config_from_args(args)
    return build_setup(args.model, args.gpu, engine, efficiency=args.efficiency,
                       num_gpu_blocks_override=args.num_gpu_blocks_override, multimodal=multimodal_flags(args),
                       layer_pattern=args.layer_pattern, sliding_window=args.sliding_window,
                       micro_batches=args.pipeline_micro_batches, pipeline_link_gbs=args.pipeline_link_gbs)


def workload_from_args(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace:
        return load_trace(args.trace)
    return generate_workload(workload_spec_from_args(args))


def parse_sweep(text: str) -> tuple[str, list[int]]:
    name, _, values = text.partition("=")
    name = name.strip().lstrip("-")
    if name not in SWEEPS or not values:
        raise UserError(f"--sweep {text!r}: give max-num-batched-tokens=1024,2048,... or concurrency=1,2,4,...")
    try:
        levels = [int(v.replace("_", "")) for v in values.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--sweep {text!r}: the values must be whole numbers separated by commas") from None
    if not levels or min(levels) < 1:
        raise UserError(f"--sweep {text!r}: give positive values")
    return name, levels


def render_summary(setup: SimSetup, result: SimResult) -> str:
    s = result.summary()
    plan = setup.plan
    lines = [
        f"kvscope simulate: {setup.model.name} on {setup.gpu.name} (simulated; efficiency {setup.cost.efficiency:g})",
        f"  KV pool {plan.num_blocks:,} blocks x {plan.block_size} = {plan.kv_cache_tokens:,} tokens; "
        f"max-num-seqs {setup.scheduler.max_num_seqs}, max-num-batched-tokens {setup.scheduler.max_num_batched_tokens}",
        f"  steps {s['steps']:,}   simulated {s['simulated_s']:.2f} s   ({s['steps_per_wall_s']:,.0f} steps/s of wall time)",
        f"  requests finished {s['finished']:,}, rejected {s['rejected']:,}"
        + ("" if result.completed else "   (stopped before every request finished)"),
        f"  throughput: output {s['output_tokens_per_s']:,.0f} tok/s, prompt + output {s['total_tokens_per_s']:,.0f} tok/s",
        f"  TTFT  p50 {s['ttft_p50_s'] * 1e3:,.1f} ms   p90 {s['ttft_p90_s'] * 1e3:,.1f} ms   p99 {s['ttft_p99_s'] * 1e3:,.1f} ms",
        f"  ITL   p50 {s['itl_p50_s'] * 1e3:,.1f} ms   p90 {s['itl_p90_s'] * 1e3:,.1f} ms   p99 {s['itl_p99_s'] * 1e3:,.1f} ms"
        f"   max {s['itl_max_s'] * 1e3:,.1f} ms",
        f"  preemptions {s['preemptions']:,}   peak running {s['peak_running']}   peak waiting {s['peak_waiting']}   "
        f"peak pool use {s['peak_pool_fraction'] * 100:.1f} %",
        f"  binding limit: {s['binding_limit']}  (steps with requests waiting on: "
        + ", ".join(f"{k} {v}" for k, v in s["limit_steps"].items())
        + f"; KV pool binds above ~{concurrency_crossover_tokens(setup):,.0f} tokens per request)",
    ]
    lines += parallel_lines(setup, result)
    if result.encoder_cache_capacity:
        lines.append(f"  encoder: {result.encoder_items:,} items ({result.encoder_tokens:,} tokens) encoded; encoder "
                     f"cache peak {result.peak_encoder_cache_tokens:,} of {result.encoder_cache_capacity:,} tokens")
    return "\n".join(lines)


def parallel_lines(setup: SimSetup, result: SimResult) -> list[str]:
    """The layout's stages (``engine plan -pp``'s table) and their bubbles, and each DP rank's share."""
    lines = []
    if setup.pipeline is not None and setup.pipeline_cost is not None:
        cost = setup.pipeline_cost
        lines.append(f"  pipeline: {len(setup.pipeline.stages)} stages x --tensor-parallel-size "
                     f"{setup.engine.tensor_parallel_size}, {cost.micro_batches} micro-batches per step, "
                     f"{cost.link_bytes_s / 1e9:g} GB/s between stages (each GPU, as engine plan -pp):")
        lines += ["  " + line for line in stage_lines(setup.pipeline)]
        idle = result.pipeline
        if idle.stages:
            lines.append("  bubble (share of step time each stage waited): " + ", ".join(
                f"stage {i} {f * 100:.1f} %" for i, f in enumerate(idle.fractions))
                + f"; fill-drain floor {fill_drain_bubble(idle.stages, cost.micro_batches) * 100:.1f} %; "
                f"{idle.bytes_per_step()[0] / 2**20:,.1f} MiB sent per step by stage 0")
    if isinstance(result, DataParallelResult):
        b = result.balance
        lines.append(f"  data parallel: {b.size} ranks behind vLLM's balancer (least 4 x waiting + running); "
                     f"max/mean: requests {b.spread([r.requests for r in b.ranks.values()]):.2f}, "
                     f"time-averaged load {b.spread([b.mean_load(r) for r in range(b.size)]):.2f}; "
                     f"{b.queued_share() * 100:.1f} % of steps with the busiest rank queueing beyond "
                     f"{DP_IMBALANCE_BOUND:g}x the mean")
        for r in range(b.size):
            load = b.rank(r)
            lines.append(f"    rank {r}: {load.requests:,} requests, {load.output_tokens:,} output tokens, "
                         f"{load.steps:,} steps, waiting + running {b.mean_load(r):,.1f} on average "
                         f"(peak {load.peak_load}), peak KV {load.peak_kv_usage * 100:.1f} %")
    return lines


def render_rows(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    head = "  ".join(f"{title:>{len(title) if len(title) > 10 else 10}}" for _, title, _ in columns)
    out = [head]
    for row in rows:
        cells = []
        for key, title, fmt in columns:
            w = len(title) if len(title) > 10 else 10
            cells.append(f"{format(row[key], fmt):>{w}}")
        out.append("  ".join(cells))
    return "\n".join(out)


TOKENS_COLUMNS = [("max_num_batched_tokens", "max-num-batched-tokens", ",d"), ("ttft_steps", "TTFT steps", "d"),
                  ("ttft_ms", "TTFT ms", ",.1f"), ("worst_itl_ms", "worst ITL others ms", ",.1f")]
CONCURRENCY_COLUMNS = [("concurrency", "users", "d"), ("output_tokens_per_s", "output tok/s", ",.0f"),
                       ("ttft_p50_ms", "TTFT p50 ms", ",.1f"), ("ttft_p99_ms", "TTFT p99 ms", ",.1f"),
                       ("itl_p50_ms", "ITL p50 ms", ",.1f"), ("itl_p99_ms", "ITL p99 ms", ",.1f"),
                       ("preemptions", "preemptions", "d")]


def _with_ms(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        r = dict(row)
        for key in list(row):
            if key.endswith("_s") and isinstance(row[key], float):
                r[key[:-2] + "_ms"] = row[key] * 1e3
        if "worst_itl_others_s" in row:
            r["worst_itl_ms"] = row["worst_itl_others_s"] * 1e3
        out.append(r)
    return out


def plot_sweep(name: str, rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, which `make setup` installs: run make setup") from None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8))
    if name == "max-num-batched-tokens":
        labels = [str(r["max_num_batched_tokens"]) for r in rows]
        a1.bar(labels, [r["ttft_ms"] for r in rows], color="#f28e2b")
        a1.set_title(f"TTFT of a {rows[0]['long_prompt_tokens']:,}-token prompt")
        a2.bar(labels, [r["worst_itl_ms"] for r in rows], color="#4e79a7")
        a2.set_title("worst inter-token latency for everyone else")
        for ax in (a1, a2):
            ax.set_xlabel("--max-num-batched-tokens")
            ax.set_ylabel("ms")
    else:
        users = [r["concurrency"] for r in rows]
        a1.plot(users, [r["output_tokens_per_s"] for r in rows], "o-", color="#59a14f")
        a1.set_ylabel("output tokens / s (all users)")
        a1.set_title("throughput")
        for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-"), ("itl_p99_ms", "s--")):
            a2.plot(users, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
        a2.set_yscale("log")
        a2.set_ylabel("ms")
        a2.legend(fontsize=8)
        a2.set_title("latency")
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent users")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_sweep(args: argparse.Namespace, setup: SimSetup) -> int:
    """``--sweep NAME=LEVELS``: one simulated run per level, a row each (and a plot)."""
    if args.otlp_traces_endpoint or args.trace_out:
        raise UserError("--otlp-traces-endpoint and --trace-out trace one run: drop --sweep, or run one level")
    name, levels = parse_sweep(args.sweep)
    if args.plot:  # fail fast, before the sweep runs, when matplotlib is missing
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'kvscope[plot]'") from None
    if name == "max-num-batched-tokens":
        rows = _with_ms(long_prompt_sweep(setup, levels))
        columns = TOKENS_COLUMNS
    else:
        rows = _with_ms(concurrency_sweep(setup, levels, prompt_range=parse_range(args.random_input_len, "--random-input-len"),
                                          output_range=parse_range(args.random_output_len, "--random-output-len"),
                                          seed=args.workload_seed))
        columns = CONCURRENCY_COLUMNS
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"kvscope simulate --sweep {name}: {setup.model.name} on {setup.gpu.name} (simulated)")
        print(render_rows(rows, columns))
    if args.plot:
        plot_sweep(name, rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def run(args: argparse.Namespace) -> int:
    setup = setup_from_args(args)
    if args.sweep:
        return _run_sweep(args, setup)
    if args.plot:
        raise UserError("--plot draws a sweep: add --sweep max-num-batched-tokens=... or --sweep concurrency=...")
    workload = workload_from_args(args)
    if setup.plan.multimodal is not None:  # every request carries the items --limit-mm-per-prompt allows
        workload = with_mm_items(workload, setup.plan.multimodal.prompt_items())
    flags = dataclasses.replace(exporter_flags(args), events_path=args.events_path,
                                kv_events_config=args.kv_events_config)
    bus = EventBus() if flags.asks() else None
    observers = attach_observers(bus, flags, simulated_clock=True, recording_config=setup.recording_config(),
                                 model_name=setup.model.name) if bus is not None else Observers()
    try:
        if setup.data_parallel_size > 1:
            if args.concurrency is not None:
                raise UserError("--concurrency with --data-parallel-size: closed-loop users are not balanced across "
                                "ranks yet; give --request-rate (or all at once)")
            result: SimResult = DataParallelSimulation(setup, bus, stats_interval=args.stats_interval if bus else 0.0
                                                       ).run(workload)
        else:
            result = Simulation(setup, bus, stats_interval=args.stats_interval if bus else 0.0).run(
                workload, concurrency=args.concurrency)
    finally:
        observers.close()
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(render_summary(setup, result))
        if args.events_path:
            print(f"  events: {args.events_path}")
        for line in observers.summary:
            print(f"  {line}")
        if (kv_events := observers.kv_events) is not None:
            print(f"  KV cache events: {kv_events.batches - kv_events.dropped:,} batches on "
                  f"{kv_events.publisher.endpoint} ({kv_events.dropped:,} dropped)")
    return 0
