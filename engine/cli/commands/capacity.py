"""engine capacity: the highest request rate that meets an SLO, for a recorded trace.

The trace's arrival pattern is replayed scaled in rate through the real scheduler and KV pool
(engine simulate's loop) and the rate is bisected to the highest one whose latencies meet
--slo. On this machine (--hardware this, the default for a kvscope recording) a step costs
what a least-squares fit to the recording's own steps says; on a GPU preset, the roofline.
It names what held the rate (KV blocks, compute, max-num-seqs or the queue) and the fix that
moves it, in flags, with the rate that fix reaches.

Traces: a kvscope recording, a vllm bench serve result JSON (run-workload --result-json), an
aiperf profile_export.jsonl, a Mooncake trace, or a vLLM log's stats lines (rates only).

Examples:
  engine capacity --trace run.jsonl --slo ttft_p99=2s,itl_p99=200ms --plot capacity.png
  engine capacity --trace mooncake.jsonl --slo ttft_p90=1s,tpot_mean=50ms --hardware h100-80gb --model llama-3.1-8b
  engine capacity --trace vllm.log --random-input-len 2000 --slo ttft_p99=3s --hardware h200 -tp 2 --target-rate 40
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from engine.budget.memory import GPU_PRESETS
from engine.cli.flags import add_aliased
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.sim.capacity import (
    DEFAULT_TOLERANCE,
    NONE,
    Binding,
    Objective,
    Search,
    binding_constraint,
    describe_slo,
    parse_slo,
    points_table,
    search_capacity,
    seconds,
    short_trace_note,
)
from engine.sim.capacity_setup import (
    THIS,
    Deployment,
    Fix,
    Overrides,
    fixes_for,
    gpu_deployment,
    this_machine,
)
from engine.sim.replay import load_recording
from engine.sim.step_fit import fit_recording
from engine.sim.traces import TRACE_FORMATS, Trace, arrival_rate, read_trace, repeat_requests
from engine.sim.workload import WorkloadRequest


def register(sub: Subparsers) -> None:
    p = sub.add_parser("capacity", help="the highest request rate a trace can be served at within an SLO",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="FILE", help="the workload: a recording, bench result, aiperf "
                   "or Mooncake JSONL, or a vLLM log")
    p.add_argument("--trace-format", default="auto", choices=["auto", *TRACE_FORMATS],
                   help="the trace's format (default: told from its first bytes)")
    p.add_argument("--slo", required=True, metavar="SPEC",
                   help="objectives, all to be met: METRIC_STAT=VALUE, comma-separated; metrics ttft, itl, tpot, e2e; "
                        "stats p50..p99.9, mean, median; e.g. ttft_p99=2s,itl_p99=200ms")
    p.add_argument("--hardware", default=None, metavar="this|PRESET",
                   help=f"this machine (a cost fitted to a recording) or a GPU preset: {', '.join(GPU_PRESETS)} "
                        "(default: this, when there is a recording)")
    p.add_argument("--fit", default=None, metavar="RECORDING",
                   help="with --hardware this: the recording whose steps fit the cost (default: the trace itself)")
    p.add_argument("--model", default=None, help="with a GPU preset: the model (default: the trace's, else llama-3.1-8b)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="T", help="GPUs per replica (presets)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="D",
                   help="replicas behind vLLM's balancer (this machine: D machines like it)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the recording's, or vLLM's 256")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the recording's, or vLLM's 8192")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the recording's, or the model's")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N", help="fix the KV pool at N blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU presets (default 0.9)")
    p.add_argument("--efficiency", type=float, default=0.6, help="GPU presets: fraction of peak reached (default 0.6)")
    add_aliased(p, "--random-input-len", type=int, default=None, metavar="N",
                   help="a vLLM log's prompt length in tokens (its stats lines give rates, not requests; default 1024)")
    add_aliased(p, "--random-output-len", type=int, default=None, metavar="N",
                   help="a vLLM log's output length (default: from its generated / prompt token ratio)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals drawn for traces without times")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="play the trace N times back to back, so a short one reaches a steady queue (default 1)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"bisect until the bracket is this fraction wide (default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--target-rate", type=float, default=None, metavar="REQ/S",
                   help="size the data-parallel fix for this rate")
    p.add_argument("--fixes", action=argparse.BooleanOptionalAction, default=True,
                   help="search again with each fix of the binding constraint (default on)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw latency against request rate")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def overrides_from_args(args: argparse.Namespace) -> Overrides:
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size), ("--data-parallel-size",
                        args.data_parallel_size), ("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens",
                        args.max_num_batched_tokens), ("--max-model-len", args.max_model_len),
                        ("--num-gpu-blocks-override", args.num_gpu_blocks_override)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be at least 1")
    return Overrides(args.tensor_parallel_size, args.data_parallel_size, args.max_num_seqs,
                     args.max_num_batched_tokens, args.max_model_len, args.num_gpu_blocks_override,
                     args.gpu_memory_utilization, args.efficiency)


def deployment_from_args(args: argparse.Namespace, trace: Trace) -> Deployment:
    hardware = (args.hardware or (THIS if args.fit or trace.recording is not None else "")).lower()
    if not hardware:
        raise UserError(f"--trace {args.trace} is not a kvscope recording, so there is no step to fit this machine's "
                        f"cost to: give --fit RECORDING, or --hardware with a GPU preset ({', '.join(GPU_PRESETS)})")
    overrides = overrides_from_args(args)
    if hardware != THIS:
        return gpu_deployment(args.model or trace.model, hardware, overrides)
    recording = load_recording(args.fit) if args.fit else trace.recording
    if recording is None:
        raise UserError("--hardware this needs a recording to fit the step cost to: give --fit RECORDING")
    return this_machine(recording, fit_recording(recording.events), overrides)


def servable(trace: Trace, dep: Deployment) -> list[WorkloadRequest]:
    """The trace's requests that fit --max-model-len (the others would be refused, not served)."""
    limit = dep.setup.scheduler.max_model_len
    kept = [r for r in trace.requests if r.prompt_tokens + r.output_tokens <= limit]
    if len(kept) < len(trace.requests):
        trace.notes.append(f"{len(trace.requests) - len(kept)} requests longer than max-model-len {limit:,} left out")
    if len(kept) < 2:
        raise UserError(f"--trace {trace.path}: fewer than 2 requests fit max-model-len {limit:,}; raise --max-model-len")
    return kept


def run(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    if args.plot:
        _check_matplotlib()
    trace = read_trace(args.trace, args.trace_format, seed=args.seed, input_len=args.random_input_len,
                       output_len=args.random_output_len)
    dep = deployment_from_args(args, trace)
    requests = repeat_requests(servable(trace, dep), args.repeat)
    base = arrival_rate(requests)
    search = search_capacity(dep.setup, requests, base, slo, tolerance=args.tolerance)
    binding = binding_constraint(search, slo)
    fixes: list[tuple[Fix, Search]] = []
    if args.fixes and binding.name != NONE:
        start = (search.best or search.points[-1]).scale  # each fix's search starts where this one ended
        for fix in fixes_for(dep, binding.name, search.max_rate, args.target_rate):
            fixes.append((fix, search_capacity(fix.deployment.setup, requests, base, slo, start=start,
                                               tolerance=args.tolerance)))
    warning = short_trace_note(search, requests)
    if args.json:
        print(json.dumps({**result_dict(trace, dep, slo, search, binding, fixes), "warning": warning}))
    else:
        print("\n".join(render(trace, dep, slo, search, binding, fixes, warning)))
    if args.plot:
        plot_capacity(search, slo, args.plot, title=f"{dep.model} on {dep.hardware}: {trace.path}")
        if not args.json:
            print(f"  wrote {args.plot}")
    return 0


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'kvscope[plot]'") from None


def _values(point_values: dict[str, float], slo: Sequence[Objective]) -> str:
    return ", ".join(f"{o.label()} {seconds(point_values[o.key])}" for o in slo)


def render(trace: Trace, dep: Deployment, slo: Sequence[Objective], search: Search, binding: Binding,
           fixes: list[tuple[Fix, Search]], warning: str | None = None) -> list[str]:
    lines = [f"kvscope capacity: {trace.path}", f"  trace: {trace.describe()}"]
    lines += [f"    note: {note}" for note in trace.notes]
    lines.append(f"  deployment: {dep.describe()}")
    if dep.fit is not None:
        lines += [f"  cost: fitted to the recording's steps: {dep.fit.formula()}", f"    {dep.fit.quality()}"]
    else:
        lines.append(f"  cost: the roofline at {dep.setup.cost.efficiency:g} of {dep.setup.gpu.name}'s peak")
    lines.append(f"  SLO: {describe_slo(slo)}")
    best, broke = search.best, search.broke
    if best is None:
        lines.append(f"  max rate: none: the SLO breaks even at {broke.rate:.3g} req/s ({broke.scale:.3g}x the "
                     f"trace's rate, requests nearly alone): {_values(broke.values, slo)}" if broke else "  max rate: none")
    else:
        bound = "at least " if broke is None else ""
        lines.append(f"  max rate: {bound}{best.rate:.4g} req/s ({best.scale:.3g}x the trace's rate), where "
                     f"{_values(best.values, slo)}")
    if warning:
        lines.append(f"    note: {warning}")
    lines.append(f"  search: {search.runs} simulations (bracketed by doubling or halving the rate, then bisected to "
                 f"a bracket {search_width(search)}) in {search.wall_s:.2f} s")
    lines.append(f"  binding constraint: {binding.name}: {binding.detail}")
    for fix, found in fixes:
        gain = found.max_rate / search.max_rate - 1 if search.max_rate else 0.0
        lines.append(f"  fix: {fix.label} -> {found.max_rate:.4g} req/s ({gain * 100:+.0f} %; {found.runs} simulations)")
    return lines


def search_width(search: Search) -> str:
    if search.best is None or search.broke is None:
        return "open at one end"
    return f"{(search.broke.scale / search.best.scale - 1) * 100:.1f} % wide"


def result_dict(trace: Trace, dep: Deployment, slo: Sequence[Objective], search: Search, binding: Binding,
                fixes: list[tuple[Fix, Search]]) -> dict[str, Any]:
    return {
        "trace": {"path": trace.path, "format": trace.kind, "requests": len(trace.requests), "rate": trace.rate,
                  "timed": trace.timed, "notes": trace.notes},
        "deployment": {"hardware": dep.hardware, "model": dep.model, "num_blocks": dep.num_blocks,
                       "block_size": dep.block_size, "max_num_seqs": dep.setup.scheduler.max_num_seqs,
                       "max_num_batched_tokens": dep.setup.scheduler.max_num_batched_tokens,
                       "tensor_parallel_size": dep.overrides.tensor_parallel_size,
                       "data_parallel_size": dep.setup.data_parallel_size},
        "fit": dep.fit.to_dict() if dep.fit is not None else None,
        "slo": {o.key: o.limit_s for o in slo},
        "max_rate": search.max_rate if search.best is not None else None,
        "bounded": search.broke is not None,
        "simulations": search.runs,
        "search_s": search.wall_s,
        "binding": {"constraint": binding.name, "detail": binding.detail, "violated": list(binding.violated),
                    "queued_share": binding.queued_share, "head_waits": binding.head_waits},
        "fixes": [{"fix": fix.label, "max_rate": found.max_rate, "simulations": found.runs} for fix, found in fixes],
        "points": points_table(search, slo),
    }


def plot_capacity(search: Search, slo: Sequence[Objective], path: str, title: str = "") -> None:
    """Each objective's value against the request rate, its limit and the rate found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = points_table(search, slo)
    fig, axes = plt.subplots(1, len(slo), figsize=(5.5 * len(slo), 3.8), squeeze=False)
    for ax, objective in zip(axes[0], slo, strict=True):
        rates = [r["rate"] for r in rows]
        values = [r[objective.key + "_s"] * 1e3 for r in rows]
        ax.plot(rates, values, "-", color="#4e79a7", zorder=1)
        ax.scatter(rates, values, c=["#59a14f" if r["ok"] else "#e15759" for r in rows], zorder=2, s=22)
        ax.axhline(objective.limit_s * 1e3, color="#f28e2b", linestyle="--", label=f"SLO {seconds(objective.limit_s)}")
        if search.best is not None:
            ax.axvline(search.max_rate, color="#76b7b2", linestyle=":", label=f"max {search.max_rate:.3g} req/s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{objective.label()} (ms)")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
