"""vLLM's own memory budget read from a log: each figure from the line that prints it, or
derived from the others with a note saying how."""

from __future__ import annotations

from typing import Any

from engine.budget.memory import gpu_preset
from logparse.check import unit
from logparse.options import Options


def _total_gib(facts: dict[str, Any], options: Options) -> tuple[float | None, str]:
    if "total_gib" in facts:
        return float(facts["total_gib"]), "log"
    if options.gpu_memory_gib is not None:
        return options.gpu_memory_gib, "--gpu-memory"
    if options.gpu:
        return gpu_preset(options.gpu).total_gib, f"--gpu {options.gpu}"
    return None, "unknown"


def vllm_budget(facts: dict[str, Any], printed: dict[str, str], options: Options) -> dict[str, Any]:
    """vLLM's budget from whatever lines exist; derived figures say how they were derived."""
    total, total_src = _total_gib(facts, options)
    weights = facts.get("weights_gib")
    peak = facts.get("peak_activation_gib")
    non_torch = facts.get("non_torch_gib")
    graph = facts.get("cuda_graph_gib")
    kv = facts.get("kv_cache_gib")
    non_kv, non_kv_src = facts.get("non_kv_gib"), "log"
    if non_kv is None and None not in (weights, peak, non_torch):
        non_kv, non_kv_src = weights + peak + non_torch, "weights + activation peak + non-torch"
    elif non_kv is None and "consumed_gib" in facts and peak is not None:
        non_kv, non_kv_src = facts["consumed_gib"] + peak, "consumed + activation peak"
    util, util_src = facts.get("gpu_memory_utilization"), "log"
    if util is None and options.gpu_memory_utilization is not None:
        util, util_src = options.gpu_memory_utilization, "--gpu-memory-utilization"
    requested, requested_src = facts.get("requested_gib"), "log"
    if requested is None and total is not None and util is not None:
        requested, requested_src = total * util, "total x utilization"
    elif requested is None and kv is not None and non_kv is not None:
        requested, requested_src = kv + non_kv, "KV pool + non-KV"
    if util is None and requested is not None and total:
        util, util_src = requested / total, "requested / total"
    remainder = None
    if requested is not None and kv is not None and non_kv is not None:
        remainder = requested - non_kv - kv
    return {
        "total_gib": total, "total_source": total_src,
        "gpu_memory_utilization": util, "gpu_memory_utilization_source": util_src if util is not None else None,
        "requested_gib": requested, "requested_source": requested_src if requested is not None else None,
        "weights_gib": weights, "peak_activation_gib": peak, "non_torch_gib": non_torch,
        "non_kv_gib": non_kv, "non_kv_source": non_kv_src if non_kv is not None else None,
        "cuda_graph_gib": graph, "kv_cache_gib": kv,
        "unexplained_gib": remainder,
        "outside_budget_gib": (total - requested) if total is not None and requested is not None else None,
    }


def remainder_tolerance(printed: dict[str, str]) -> float:
    """The precision of KV = requested - non-KV as printed: one unit of each figure's last digit."""
    return unit(printed.get("kv_cache_gib")) + unit(printed.get("requested_gib") or "0.01") + (
        unit(printed.get("non_kv_gib")) if "non_kv_gib" in printed else sum(
            unit(printed.get(k)) for k in ("weights_gib", "peak_activation_gib", "non_torch_gib")))
