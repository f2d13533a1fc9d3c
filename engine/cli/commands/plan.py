"""``engine plan``: the memory budget for a model on a GPU, before anything runs.

Prints the lines a vLLM user knows ("GPU KV cache size: N tokens", "Maximum
concurrency ..."), the ledger and a bar; ``--json`` prints the same as one
object; ``--events`` writes the planned startup as events so consumers can be
built before the engine runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

from engine.budget.memory import (
    GiB,
    MemoryPlan,
    MiB,
    gpu_preset,
    kv_cache_size_line,
    kv_dtype_bytes,
    kv_scale_bytes,
    max_concurrency_line,
    plan_memory,
)
from engine.budget.stages import PipelinePlan, plan_stages, stage_lines
from engine.budget.vision import MultimodalBudget, encoder_cache_line, multimodal_from_flags
from engine.cli.flags import (
    add_budget_flags,
    add_model_flags,
    add_multimodal_flags,
    add_scheduler_flags,
    gib_type,
    model_from_args,
    multimodal_flags,
)
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.events import PHASES, EngineConfigEvent, EventBus, JsonlSink, StartupPhase
from engine.events.ledger import label
from engine.model.cpu_caps import DtypeChoice, choose_cpu_dtype, detect
from engine.model.plan.setting import AUTO_DTYPE, AUTO_DTYPE_REASON, plan_enabled
from engine.model.plan.store import stored_for_model
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config

BAR_SEGMENTS: tuple[tuple[str, str], ...] = (
    (label("weights_bytes"), "blue"),
    (label("non_torch_bytes"), "grey50"),
    (label("activation_peak_bytes"), "dark_orange"),
    (label("kv_pool_bytes"), "green"),
    ("outside budget", "red"),
)


def register(sub: Subparsers) -> None:
    p = sub.add_parser("plan", help="compute the memory budget and KV cache size for a model on a GPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_budget_flags(p)
    add_scheduler_flags(p)
    add_multimodal_flags(p)
    p.add_argument("--gpu", default=None, help="GPU preset (h100-80gb, h200, a100-80gb, a100-40gb, l40s, l4, rtx-4090, rtx-3090)")
    p.add_argument("--gpu-memory", type=gib_type("--gpu-memory"), default=None, metavar="GiB",
                   help="total device memory in GiB, instead of --gpu")
    p.add_argument("--weights", type=gib_type("--weights"), default=None, metavar="GiB",
                   help="weights size (default: exact parameter count from the shapes x dtype bytes)")
    p.add_argument("--activation-peak", type=gib_type("--activation-peak"), default=None, metavar="GiB",
                   help="phase D peak (default: estimated from the shapes)")
    p.add_argument("--non-torch", type=gib_type("--non-torch"), default=None, metavar="GiB",
                   help="non-torch memory (default: estimated)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--events", default=None, metavar="PATH", help="write the planned startup as a JSONL event file")
    p.set_defaults(func=run)


def build_plan(args: argparse.Namespace, *, text_only: bool = False,
               full_attention: bool = False) -> tuple[ModelConfig, MemoryPlan, str]:
    """The plan for the flags; ``text_only`` leaves a VL model's vision tower out (the
    comparison that shows what the encoder costs); ``full_attention`` gives every layer
    full attention's blocks (vLLM's --disable-hybrid-kv-cache-manager: the comparison that
    shows what a sliding window buys)."""
    model = load_model_config(model_from_args(args))
    if args.gpu and args.gpu_memory is not None:
        raise UserError("give either --gpu or --gpu-memory, not both")
    if args.gpu_memory is not None:
        if args.gpu_memory <= 0:
            raise UserError(f"--gpu-memory {args.gpu_memory}: must be a positive number of GiB")
        total, gpu_name = args.gpu_memory * GiB, f"{args.gpu_memory:g} GiB device"
    else:
        preset = gpu_preset(args.gpu or "h100-80gb")
        total, gpu_name = preset.total_gib * GiB, f"{preset.name} ({preset.total_gib:g} GiB)"
    dtype = model.dtype if args.dtype == "auto" else args.dtype
    multimodal = None if text_only else multimodal_from_flags(
        model, **multimodal_flags(args), max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, dtype=dtype, tensor_parallel_size=args.tensor_parallel_size)
    plan = plan_memory(**plan_kwargs(args, model, total, dtype, multimodal, text_only, full_attention))
    return model, plan, gpu_name


def plan_kwargs(args: argparse.Namespace, model: ModelConfig, total: float, dtype: str,
                multimodal: Any = None, text_only: bool = False, full_attention: bool = False) -> dict[str, Any]:
    """``plan_memory``'s keywords from the flags (the whole replica's, or with the weights
    left out a pipeline stage's: engine/budget/stages.py)."""
    return dict(
        model=model,
        total_bytes=int(total),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len or model.max_position_embeddings,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        weights=None if args.weights is None else int(args.weights * GiB),
        activation_peak=None if args.activation_peak is None else int(args.activation_peak * GiB),
        non_torch=None if args.non_torch is None else int(args.non_torch * GiB),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        multimodal=multimodal,
        check_fits=not (text_only or full_attention),
        disable_hybrid_kv_cache_manager=full_attention,
    )


def pipeline_plan(args: argparse.Namespace, model: ModelConfig, plan: MemoryPlan) -> PipelinePlan | None:
    """``-pp P``: every stage's budget on its own GPU (engine/budget/stages.py)."""
    stages = getattr(args, "pipeline_parallel_size", None) or 1
    if stages == 1:
        return None
    kwargs = plan_kwargs(args, model, plan.total_bytes, model.dtype if args.dtype == "auto" else args.dtype)
    for name in ("model", "check_fits", "multimodal"):
        kwargs.pop(name)
    return plan_stages(model, stages, **kwargs)


def full_attention_comparison(args: argparse.Namespace, plan: MemoryPlan) -> dict[str, Any] | None:
    """A hybrid plan beside the same model with full attention everywhere: blocks, tokens,
    concurrency, and how many times the concurrency the sliding window buys."""
    if not plan.is_hybrid:
        return None
    _, full, _ = build_plan(args, full_attention=True)
    return {**full.layout_summary(), "fits_one_request": full.kv_cache_tokens >= full.max_model_len,
            "concurrency_gain": plan.max_concurrency / full.max_concurrency if full.max_concurrency else None}


def plan_json(model: ModelConfig, plan: MemoryPlan, gpu_name: str,
              full_attention: dict[str, Any] | None = None) -> dict[str, Any]:
    out = plan.to_json()
    if full_attention is not None:
        out["full_attention_everywhere"] = full_attention
    out["model"] = model.name
    out["gpu"] = gpu_name
    out["num_parameters"] = model.num_parameters
    out.update(moe_summary(model, plan))
    out["host_cpu"] = host_cpu_summary()
    return out


def moe_summary(model: ModelConfig, plan: MemoryPlan) -> dict[str, Any]:
    """A mixture-of-experts model's parameters one token uses and its experts' share of the
    weights (bytes: that share of the plan's weights, so dtype and tensor parallelism follow);
    empty for a dense model."""
    if not model.is_moe:
        return {}
    return {"num_active_parameters": model.num_active_parameters, "expert_parameters": model.expert_parameters,
            "expert_weights_bytes": plan.weights_bytes * model.expert_parameters // model.num_parameters,
            "num_experts": model.num_experts, "num_experts_per_tok": model.num_experts_per_tok,
            "num_moe_layers": model.num_moe_layers}


def host_cpu_summary() -> dict[str, Any]:
    """This machine's CPU and what ``--dtype auto`` picks on it when the engine runs
    without a GPU (the plan itself is for the device named by --gpu/--gpu-memory)."""
    caps = detect()
    choice = choose_cpu_dtype(caps)
    if plan_enabled():
        choice = DtypeChoice(AUTO_DTYPE, AUTO_DTYPE_REASON)
    return {**caps.summary(), "auto_dtype": choice.dtype, "auto_dtype_reason": choice.reason}


def write_plan_events(path: str, model: ModelConfig, plan: MemoryPlan, args: argparse.Namespace) -> None:
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "json", "events")}
    bus = EventBus(clock=lambda: 0.0)
    sink = JsonlSink(path, config=flags)
    bus.subscribe(sink)
    try:
        summary = model.summary()
        summary["bytes_per_kv_token"] = plan.bytes_per_token
        bus.publish(EngineConfigEvent(config=flags, model=summary, planned=True))
        records = plan.phase_records()
        for letter, name in PHASES.items():
            if letter == "F":
                bus.publish(StartupPhase(phase=letter, name=name, status="skipped", planned=True,
                                         reason="plan mode: CUDA-graph memory is not measured"))
                continue
            record = records.get(letter)
            bus.publish(StartupPhase(phase=letter, name=name, status="end", planned=True,
                                     data=record.to_dict() if record is not None else {}))
    finally:
        sink.close()


def _row(label: str, gib: float, note: str = "") -> str:
    return f"  {label:<32}{gib:>10.3f} GiB{('   ' + note) if note else ''}"


def _print_model(console: Console, model: ModelConfig, plan: MemoryPlan, gpu_name: str,
                 args: argparse.Namespace) -> None:
    """The model, its parameters and what one KV token costs (per group on a hybrid model)."""
    kv_b = kv_dtype_bytes(args.kv_cache_dtype, model.dtype if args.dtype == "auto" else args.dtype)
    kv_heads = max(1, model.num_kv_heads // args.tensor_parallel_size)
    mm = plan.multimodal
    params = (f"{model.num_parameters:,} parameters" if mm is None else
              f"{model.num_parameters:,} LLM + {mm.vision_parameters:,} vision parameters")
    moe = moe_summary(model, plan)
    if moe:
        params += (f", {moe['num_active_parameters']:,} active per token: {moe['num_experts_per_tok']} of "
                   f"{moe['num_experts']} experts in {moe['num_moe_layers']} MoE layers; expert weights "
                   f"{moe['expert_parameters']:,} parameters, {moe['expert_weights_bytes'] / GiB:.2f} GiB")
    console.print(f"[bold]kvscope plan[/]: {model.name} ({params}) on {gpu_name}, "
                  f"TP {args.tensor_parallel_size}", highlight=False)
    scale = kv_scale_bytes(args.kv_cache_dtype)
    row = f"({model.head_dim} head dim x {kv_b:g} B + {scale} B scale)" if scale else f"{model.head_dim} head dim x {kv_b:g} B"
    every = plan.full_attention_bytes_per_token if plan.is_hybrid else plan.bytes_per_token
    console.print(f"  bytes per KV token = 2 x {model.num_layers} layers x {kv_heads} KV heads x "
                  f"{row} = {every:,} B ({every / 1024:.1f} KiB)"
                  + (" if every layer kept every token" if plan.is_hybrid else ""), highlight=False)
    if plan.is_hybrid:
        for line in hybrid_group_lines(plan):
            console.print(line, highlight=False)
    console.print()


def _ledger_rows(plan: MemoryPlan, args: argparse.Namespace) -> list[str]:
    """The memory ledger, each quantity with where it came from (given, or from shapes)."""
    def note(name: str, given: float | None) -> str:
        if given is not None:
            return "given"
        return "estimated from shapes" if name in plan.estimated else "from shapes"

    lines = [
        _row(label("total_bytes"), plan.total_bytes / GiB),
        _row(f"{label('requested_bytes')} (x {plan.gpu_memory_utilization:g})", plan.requested_bytes / GiB),
        _row(f"- {label('weights_bytes')}", plan.weights_bytes / GiB, note("weights", args.weights)),
        _row(f"- {label('activation_peak_bytes')} (phase D)", plan.activation_peak_bytes / GiB,
             note("activation_peak", args.activation_peak)),
        _row(f"- {label('non_torch_bytes')}", plan.non_torch_bytes / GiB, note("non_torch", args.non_torch)),
        _row(f"= {label('kv_pool_bytes')}", plan.kv_pool_bytes / GiB,
             "--kv-cache-memory-bytes" if plan.kv_pool_overridden else ""),
        _row("outside the budget (1 - util)", (plan.total_bytes - plan.requested_bytes) / GiB),
    ]
    if plan.multimodal is not None:
        lines[2:4] = multimodal_ledger_rows(plan, plan.multimodal, args)
    return lines


def render_text(console: Console, model: ModelConfig, plan: MemoryPlan, gpu_name: str, args: argparse.Namespace) -> None:
    _print_model(console, model, plan, gpu_name, args)
    mm = plan.multimodal
    lines = _ledger_rows(plan, args)
    tp = args.tensor_parallel_size
    console.print("[bold]Memory ledger[/]" + (f" (per GPU: each of the {tp} ranks holds 1/{tp} of the weights "
                                              "and of every token's KV heads)" if tp > 1 else ""), highlight=False)
    for line in lines:
        console.print(line, highlight=False)
    console.print()
    if mm is not None:
        console.print(encoder_cache_line(mm), highlight=False)
    console.print(kv_cache_size_line("GPU", plan.kv_cache_tokens)
                  + ("   (the engine's: every rank holds its heads of these tokens)" if tp > 1 else ""), highlight=False)
    console.print(max_concurrency_line(plan.max_model_len, plan.max_concurrency), highlight=False)
    console.print(f"  {plan.num_blocks:,} blocks of {plan.block_size} tokens "
                  f"({plan.block_bytes / 1024 / 1024:.2f} MiB each); "
                  f"{plan.kv_pool_bytes - plan.num_blocks * plan.block_bytes:,} bytes of pool left over", highlight=False)
    if plan.is_hybrid:
        groups = len(plan.kv_cache_groups)
        console.print(f"  tokens = {plan.num_blocks:,} blocks // {groups} groups x {plan.block_size}; concurrency = "
                      f"{plan.num_blocks:,} / {plan.blocks_per_request:,} blocks per {plan.max_model_len:,}-token "
                      "request (every group's)", highlight=False)
        full = full_attention_comparison(args, plan)
        if full is not None:
            console.print(full_attention_line(plan, full), highlight=False)
    if mm is not None:
        for line in multimodal_effect_lines(plan, mm, args):
            console.print(line, highlight=False)
    console.print()
    console.print(memory_bar(plan, per_gpu=tp > 1))
    host = host_cpu_summary()
    console.print()
    console.print(f"  this machine's CPU (for a run without a GPU): {detect().line()}; --dtype auto there is "
                  f"{host['auto_dtype']} ({host['auto_dtype_reason']})", highlight=False)
    for line in stored_kernel_plan_lines(model.name):
        console.print(line, highlight=False)


def stored_kernel_plan_lines(name: str) -> list[str]:
    """The newest kernel plan a CPU start stored for this model here (engine/model/plan/store.py;
    its table), one measured at the thread count a default start runs first (a ``--threads 1``
    start's plan is not what ``engine serve`` runs), or nothing when no start has measured one."""
    plans = stored_for_model(name)
    if not plans:
        return []
    import torch

    default_threads = torch.get_num_threads()  # a start without --threads keeps torch's default
    newest = next((p for p in plans if p.threads == default_threads), plans[0])
    return [f"  the kernel plan a CPU start measured for {name} here ({newest.threads} threads; "
            f"{len(plans)} stored for its flag sets; KVSCOPE_KERNEL_PLAN=off runs the fallback constants):",
            *(f"  {line}" for line in newest.table_lines())]


def hybrid_group_lines(plan: MemoryPlan) -> list[str]:
    """A hybrid plan's KV cache groups: vLLM's grouping, the page, the block and each group's
    bytes per token and blocks per request."""
    windows = sorted({g.sliding_window for g in plan.kv_cache_groups if g.sliding_window})
    lines = [f"  KV cache groups (vLLM's hybrid layout, window {', '.join(f'{w:,}' for w in windows)}): "
             f"{len(plan.kv_cache_groups)} groups of at most {plan.layers_per_group} layers; a block is one "
             f"{plan.block_size}-token page ({plan.page_size_bytes / 1024:g} KiB) in each of {plan.layers_per_group} "
             f"layer tensors = {plan.block_bytes / MiB:.2f} MiB"]
    for i, g in enumerate(plan.kv_cache_groups):
        spec = f"window {g.sliding_window:,}" if g.sliding_window else "full attention"
        layers = ", ".join(str(x) for x in g.layers[:4]) + (", ..." if len(g.layers) > 4 else "")
        pad = plan.layers_per_group - len(g.layers)
        lines.append(f"    group {i}: {spec:<16}{len(g.layers):>3} layers ({layers})"
                     + (f" + {pad} padding" if pad else "")
                     + f"  {g.bytes_per_token / 1024:,.1f} KiB/token  {g.blocks_per_request:,} blocks per request")
    return lines


def full_attention_line(plan: MemoryPlan, full: dict[str, Any]) -> str:
    gain = full["concurrency_gain"]
    return (f"  versus full attention everywhere (vLLM's --disable-hybrid-kv-cache-manager): {full['num_blocks']:,} blocks, "
            f"{full['kv_cache_tokens']:,} tokens, {full['max_concurrency']:.2f}x"
            + ("" if full["fits_one_request"] else f" (cannot hold one {plan.max_model_len:,}-token request)")
            + (f"; the sliding window buys {gain:.2f}x the concurrency" if gain else ""))


def multimodal_ledger_rows(plan: MemoryPlan, mm: MultimodalBudget, args: argparse.Namespace) -> list[str]:
    """The weights and phase D rows of a VL model: what the vision tower and the
    encoder add, each marked given, from shapes or estimated."""
    given_weights, given_peak = args.weights is not None, args.activation_peak is not None
    encoder = f"{mm.items_profiled} {mm.modality} items of {mm.tokens_per_item:,} tokens ({mm.item})"
    cache = f"{mm.encoder_budget_tokens:,} tokens x {mm.embedding_bytes_per_token:,} B"
    rows = [
        _row(f"- {label('weights_bytes')}", plan.weights_bytes / GiB, "given" if given_weights else "from shapes"),
        _row(f"    {label('vision_weights_bytes')}", mm.vision_weights_bytes / GiB,
             f"from shapes ({mm.vision_parameters:,} parameters)" + ("; inside the given weights" if given_weights else "")),
    ]
    if mm.skip_profiling:
        rows += [
            _row(f"- {label('activation_peak_bytes')} (phase D)", plan.activation_peak_bytes / GiB,
                 "given" if given_peak else "estimated from shapes: the text step only (--skip-mm-profiling)"),
            _row(f"    {label('encoder_activation_peak_bytes')}", mm.encoder_activation_peak_bytes / GiB,
                 f"estimated, NOT budgeted: {encoder} at runtime"),
            _row(f"    {label('encoder_cache_bytes')}", mm.encoder_cache_bytes / GiB, f"NOT budgeted: {cache}"),
        ]
        return rows
    peak_note = ("given (a measured peak holds the encoder's share)" if given_peak else
                 "estimated from shapes: max(encoder, encoder cache + LLM)")
    rows += [_row(f"- {label('activation_peak_bytes')} (phase D)", plan.activation_peak_bytes / GiB, peak_note)]
    if not given_peak:
        rows.append(_row("    LLM activation peak", plan.llm_activation_peak_bytes / GiB, "estimated from shapes"))
    rows += [
        _row(f"    {label('encoder_activation_peak_bytes')}", mm.encoder_activation_peak_bytes / GiB,
             f"estimated from shapes: {encoder}"),
        _row(f"    {label('encoder_cache_bytes')}", mm.encoder_cache_bytes / GiB,
             f"{cache} (min of compute budget {mm.encoder_compute_budget:,} and cache size {mm.encoder_cache_size:,})"),
    ]
    return rows


def multimodal_effect_lines(plan: MemoryPlan, mm: MultimodalBudget, args: argparse.Namespace) -> list[str]:
    """What the encoder costs the KV pool and concurrency against the same LLM as a
    text model, and what one prompt's items hold in KV."""
    _, text, _ = build_plan(args, text_only=True)
    lines = [f"  versus the text model alone: KV pool {text.kv_pool_bytes / GiB:.2f} -> {plan.kv_pool_bytes / GiB:.2f} GiB "
             f"({(plan.kv_pool_bytes - text.kv_pool_bytes) / GiB:+.2f} GiB, "
             f"{plan.kv_cache_tokens - text.kv_cache_tokens:+,} tokens), max concurrency "
             f"{text.max_concurrency:.2f}x -> {plan.max_concurrency:.2f}x"]
    items = ", ".join(f"{n} {m}" for m, n in mm.items_per_prompt.items() if n)
    if mm.image_tokens_in_kv:
        kv = mm.tokens_per_prompt * plan.bytes_per_token
        lines.append(f"  a prompt with {items} item(s) carries {mm.tokens_per_prompt:,} image tokens = "
                     f"{kv / MiB:,.1f} MiB of KV ({plan.bytes_per_token / 1024:.0f} KiB each), before its text")
    else:
        lines.append(f"  a prompt with {items} item(s): {mm.tokens_per_prompt:,} image states read through "
                     "cross-attention, outside the per-token KV of the text")
    return lines


def memory_bar(plan: MemoryPlan, width: int = 72, per_gpu: bool = False) -> Text:
    sizes = [
        plan.weights_bytes,
        plan.non_torch_bytes,
        plan.activation_peak_bytes,
        max(plan.kv_pool_bytes, 0),
        plan.total_bytes - plan.requested_bytes,
    ]
    total = max(sum(sizes), 1)
    bar = Text()
    legend = Text()
    for (name, colour), size in zip(BAR_SEGMENTS, sizes, strict=True):
        cells = round(width * size / total)
        if size > 0 and cells == 0:
            cells = 1
        bar.append("█" * cells, style=colour)
        legend.append("■ ", style=colour)
        legend.append(f"{name} {size / GiB:.2f} GiB  ")
    return Text.assemble("  ", bar, "\n  ", legend, "(per GPU)" if per_gpu else "")


def run(args: argparse.Namespace) -> int:
    model, plan, gpu_name = build_plan(args)
    stages = pipeline_plan(args, model, plan)
    if args.events:
        write_plan_events(args.events, model, plan, args)
    if args.json:
        out = plan_json(model, plan, gpu_name, full_attention_comparison(args, plan))
        print(json.dumps(out | ({"pipeline": stages.to_dict()} if stages is not None else {})))
        return 0
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    render_text(console, model, plan, gpu_name, args)
    if stages is not None:
        console.print()
        console.print(f"[bold]Pipeline stages[/] (-pp {len(stages.stages)}; each stage's GPUs hold its layers and "
                      "their KV; the ledger above is one GPU holding every layer)", highlight=False)
        for line in stage_lines(stages):
            console.print(line, highlight=False)
    return 0
