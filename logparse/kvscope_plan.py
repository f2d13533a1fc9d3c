"""kvscope's plan for the log's model and flags (engine/budget/memory.py's one formula, fed
the log's own figures where it prints them) and its rows beside vLLM's budget."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.budget.memory import GiB, MemoryPlan, bytes_per_kv_token, plan_memory
from engine.budget.vision import multimodal_from_flags
from engine.errors import UserError
from engine.events.ledger import BY_NAME as LEDGER_ITEM
from engine.modelspec.config import ModelConfig
from engine.modelspec.presets import resolve_preset_name
from engine.modelspec.readers import load_model_config
from logparse.options import Options
from logparse.patterns import FIGURE_NAMES
from logparse.reconcile import model_name, own_figures


def identify_model(options: Options, facts: dict[str, Any]) -> tuple[ModelConfig | None, str]:
    candidates = [(options.model, "--model")] if options.model else []
    if facts.get("model"):
        printed = model_name(str(facts["model"]))  # vLLM's elision dropped: "Qwen3-8B..." is Qwen3-8B
        candidates.append((printed, "log"))
        served = Path(printed).name  # a local folder named as the hub id: /google/gemma-3-27b-it
        if served and served != printed and resolve_preset_name(served):
            candidates.append((served, "log, the folder's name"))
    reasons: list[str] = []
    for name, origin in candidates:
        try:
            return load_model_config(name), f"{name} (from {origin})"
        except UserError as exc:
            reasons.append(f"{origin}: {exc}")
    if not candidates:
        return None, "no model named in the log; pass --model PRESET | HF folder | GGUF"
    return None, "; ".join(reasons)


def kv_dtype(facts: dict[str, Any]) -> str:
    value = str(facts.get("kv_cache_dtype", "auto")).lower()
    return "fp8" if value.startswith("fp8") else value


def model_dtype(facts: dict[str, Any], model: ModelConfig) -> str:
    value = str(facts.get("dtype", model.dtype)).replace("torch.", "").lower()
    return value if value in ("bfloat16", "float16", "float32") else model.dtype


def kv_bytes_per_token(facts: dict[str, Any], model: ModelConfig | None) -> int | None:
    if model is None:
        return None
    try:
        return bytes_per_kv_token(model, kv_dtype(facts), int(facts.get("tensor_parallel_size", 1)),
                                  model_dtype(facts, model))
    except UserError:
        return None


def _plan_inputs(facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig, total: float) -> dict[str, Any]:
    """The flags kvscope's plan takes, each from the log where it prints it, with where it came from."""
    util = budget["gpu_memory_utilization"]
    util_src = budget["gpu_memory_utilization_source"]
    if util is None:
        util, util_src = 0.9, "assumed (vLLM default)"
    max_len = facts.get("max_model_len")
    max_len_src = "log"
    if not isinstance(max_len, int) or max_len <= 0:
        max_len, max_len_src = model.max_position_embeddings, "model's max_position_embeddings"
    return {
        "total_gib": total, "gpu_memory_utilization": round(util, 6), "gpu_memory_utilization_source": util_src,
        "max_model_len": max_len, "max_model_len_source": max_len_src,
        "dtype": model_dtype(facts, model), "kv_cache_dtype": kv_dtype(facts),
        "tensor_parallel_size": int(facts.get("tensor_parallel_size", 1)),
        "block_size": int(facts.get("block_size", 16)),
        "block_size_source": facts.get("block_size_source", "log" if "block_size" in facts else "vLLM's default"),
        "max_num_batched_tokens": int(facts.get("max_num_batched_tokens", 8192)),
        "max_num_seqs": int(facts.get("max_num_seqs", 256)),
    }


def kvscope_plan(facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None, model_note: str,
                 graph: float | None) -> tuple[MemoryPlan | None, dict[str, Any]]:
    """kvscope's plan for the log's model and flags, on the log's own figures where it prints them
    (``graph``: the CUDA-graph GiB the log shows vLLM took out of the KV pool, logparse/reconcile.py)."""
    out: dict[str, Any] = {"model": model.name if model else None, "model_source": model_note,
                           "vllm": budget, "kvscope": None, "inputs": {}, "rows": [], "profile": None}
    if model is None:
        out["unavailable"] = f"kvscope plan needs the model: {model_note}"
        return None, out
    total = budget["total_gib"]
    if total is None:
        out["unavailable"] = "kvscope plan needs the device size: the log does not print it; pass --gpu or --gpu-memory"
        return None, out
    inputs = _plan_inputs(facts, budget, model, total)
    util = budget["gpu_memory_utilization"] if budget["gpu_memory_utilization"] is not None else 0.9  # unrounded
    max_len = inputs["max_model_len"]
    own = own_figures(facts)  # the log's measured weights / activation / non-torch, before any estimate
    inputs["from_log"] = sorted([*own, *(["cuda_graph"] if graph is not None else [])])
    out["inputs"] = inputs
    arguments: dict[str, Any] = dict(
        model=model, total_bytes=int(total * GiB), gpu_memory_utilization=min(1.0, max(1e-6, util)),
        max_model_len=max_len, block_size=inputs["block_size"], kv_cache_dtype=inputs["kv_cache_dtype"],
        dtype=inputs["dtype"], tensor_parallel_size=inputs["tensor_parallel_size"],
        max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
        check_fits=False, weights=own.get("weights"), activation_peak=own.get("activation_peak"),
        non_torch=own.get("non_torch"),
        multimodal=multimodal_from_flags(  # a VL preset's vision weights and encoder; None for text models
            model, max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
            dtype=inputs["dtype"], tensor_parallel_size=inputs["tensor_parallel_size"]))
    try:
        plan = plan_memory(**arguments)
        if graph is not None:  # the same pool less the graph estimate, its blocks and tokens recounted
            graph_bytes = int(graph * GiB)
            pool = plan_memory(**arguments, kv_cache_memory_bytes=max(0, plan.kv_pool_bytes - graph_bytes))
            plan = replace(pool, cuda_graph_bytes=graph_bytes, kv_pool_overridden=plan.kv_pool_overridden)
    except UserError as exc:
        out["unavailable"] = f"kvscope plan: {exc}"
        return None, out
    out["kvscope"] = plan.to_json()
    out["rows"] = _comparison_rows(facts, budget, plan)
    return plan, out


_ROW_NOTES = {
    "weights_gib": "kvscope: parameters x dtype bytes / TP from the model's shapes; vLLM: measured allocator growth "
                   "(quantised or multimodal models differ)",
    "peak_activation_gib": "kvscope estimates the spike from shapes (max-num-batched-tokens, sampler logits); vLLM "
                           "measures one dummy worst-case step",
    "non_torch_gib": "kvscope assumes a fixed 0.3 GiB (0.7 with TP); vLLM measures CUDA context growth, NCCL, workspaces",
    "cuda_graph_gib": "vLLM since v0.21 subtracts an estimated CUDA graph pool from the KV pool (kvscope's plan then "
                      "takes the log's estimate out of its pool too), earlier versions take it from the 1 - util "
                      "margin (kvscope's plan reserves nothing)",
    "kv_cache_gib": "the remainder: differs by exactly the non-KV differences above",
}


# The comparison rows, in order: each a figure of the log (FIGURE_NAMES' key); kvscope's side is
# the plan's JSON under the ledger's report key of the same quantity (engine/events/ledger.py).
_ROW_FIGURES = ("total_gib", "gpu_memory_utilization", "requested_gib", "weights_gib", "peak_activation_gib",
                "non_torch_gib", "non_kv_gib", "cuda_graph_gib", "kv_cache_gib", "kv_cache_tokens", "gpu_blocks",
                "max_concurrency")


def _comparison_rows(facts: dict[str, Any], budget: dict[str, Any], plan: MemoryPlan) -> list[dict[str, Any]]:
    planned = plan.to_json()
    mine: dict[str, float | int | None] = {}
    for key in _ROW_FIGURES:
        kvscope_name = FIGURE_NAMES[key].kvscope if key in FIGURE_NAMES else None
        item = LEDGER_ITEM.get(kvscope_name or "")
        if item is not None and item.report_key in planned:
            mine[key] = planned[item.report_key]
        elif item is not None:  # a ledger quantity the plan's JSON leaves out (its CUDA-graph reserve)
            mine[key] = item.report_value(getattr(plan, item.name))
        else:  # non-KV: the sum vLLM prints
            mine[key] = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes) / GiB
    theirs = {**{k: budget.get(k) for k in mine}, "kv_cache_tokens": facts.get("kv_cache_tokens"),
              "gpu_blocks": facts.get("gpu_blocks"), "max_concurrency": facts.get("max_concurrency")}
    rows = []
    for key, value in mine.items():
        vllm_value = theirs.get(key)
        note = _ROW_NOTES.get(key, "")
        if key in ("peak_activation_gib", "non_torch_gib") and key.split("_gib")[0].replace("peak_", "") in plan.estimated:
            note = note or "estimated"
        rows.append({"item": key, "vllm": vllm_value, "kvscope": value,
                     "difference": (value - vllm_value) if isinstance(vllm_value, int | float) else None,
                     "note": note})
    return rows
