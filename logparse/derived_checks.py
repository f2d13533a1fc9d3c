"""The checks derived from a log's printed figures: KV tokens x bytes per token, concurrency,
requested = total x utilization, non-KV's parts, KV = requested - non-KV, each within the
printed digits' tolerance (logparse/check.py)."""

from __future__ import annotations

from typing import Any

from engine.budget.memory import GiB
from engine.modelspec.config import ModelConfig
from logparse.check import Check, unit, within
from logparse.hybrid_checks import hybrid_checks, hybrid_layout
from logparse.kvscope_plan import kv_bytes_per_token
from logparse.reconcile import hybrid_concurrency, tokens_follow_concurrency
from logparse.vllm_budget import remainder_tolerance

NON_KV_PARTS = ("weights_gib", "peak_activation_gib", "non_torch_gib")


def derived_checks(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                   budget: dict[str, Any], model: ModelConfig | None) -> list[Check]:
    """Every check the log's figures allow, in order: the hybrid layout's (where it is one), KV
    tokens x bytes, concurrency, requested, non-KV, and KV = requested - non-KV."""
    checks: list[Check] = []
    tokens = facts.get("kv_cache_tokens")
    per_token = kv_bytes_per_token(facts, model)
    block = int(facts.get("block_size", 16))
    if tokens is None and facts.get("gpu_blocks") is not None:
        tokens = int(facts["gpu_blocks"]) * block
    follows = tokens_follow_concurrency(facts, lines)  # tokens = int(concurrency x max-model-len), any layout
    hybrid = hybrid_layout(facts, model)
    if hybrid is not None or facts.get("padding_layers") is not None:
        # vLLM's hybrid layout: tokens x every layer's bytes does not hold, nor (before vLLM printed the
        # tokens its concurrency implies) tokens / max-model-len
        checks += hybrid_checks(facts, printed, lines, hybrid, model, follows)
        per_token = None
        tokens = tokens if follows else None
    found = (_kv_tokens_check(facts, printed, lines, tokens, per_token, block),
             _concurrency_check(facts, printed, lines, tokens, follows),
             _requested_check(facts, printed, lines),
             _non_kv_check(facts, printed, lines),
             _kv_remainder_check(facts, printed, lines, budget))
    return checks + [check for check in found if check is not None]


def _kv_tokens_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int], tokens: int | None,
                     per_token: int | None, block: int) -> Check | None:
    """KV pool = tokens x bytes per token, within the printed digit and one block."""
    kv = facts.get("kv_cache_gib")
    if tokens is None or kv is None or per_token is None or tokens <= 0:
        return None
    actual = tokens * per_token / GiB
    tol = unit(printed.get("kv_cache_gib")) + block * per_token / GiB
    ok = within(actual, kv, tol)
    return Check(
        "kv_tokens_x_bytes", "tokens x bytes per token = KV pool", ok,
        f"{tokens:,} tokens x {per_token / 1024:g} KiB/token = {actual:.3f} GiB against a printed {printed.get('kv_cache_gib', kv)} GiB"
        f" (tolerance {tol:.3f}: one unit of the printed digit + one block)"
        + ("" if ok else "; vLLM may pad layers, use hybrid/sliding-window groups, or the model/KV dtype differs"),
        formula="kv_cache_tokens x bytes_per_token / 2^30", expected=kv, actual=round(actual, 4), tolerance=tol,
        line=lines.get("kv_cache_tokens", lines.get("gpu_blocks")))


def _concurrency_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int], tokens: int | None,
                       follows: bool) -> Check | None:
    """Concurrency = tokens / max-model-len; a hybrid model's higher figure explained, not judged."""
    max_len = facts.get("max_model_len")
    conc = facts.get("max_concurrency")
    if tokens is None or not isinstance(max_len, int) or max_len <= 0 or conc is None:
        return None
    actual = tokens / max_len
    tol = unit(printed.get("max_concurrency"))
    ok: bool | None = within(actual, conc, tol)
    why = "; since 0.9.2 vLLM counts blocks per request, which differs for sliding-window or hybrid models"
    if not ok and "hybrid_hint_line" in facts and not follows and hybrid_concurrency(conc, tokens, max_len, tol):
        # a line names Mamba / linear attention / padding layers (logparse/reconcile.py): not judged, explained
        ok, why = None, ("; vLLM counted blocks per request over its KV cache groups (Mamba / linear-attention "
                         "state takes one block, a sliding window its window), so its figure is higher: pass "
                         "--model to reconcile it")
    return Check(
        "concurrency", "concurrency = tokens / max-model-len", ok,
        f"{tokens:,} / {max_len:,} = {actual:.4f} against a printed {printed.get('max_concurrency', conc)}x"
        f" (tolerance {tol:g})" + ("" if ok else why),
        formula="kv_cache_tokens / max_model_len", expected=conc, actual=round(actual, 4), tolerance=tol,
        line=lines.get("max_concurrency"))


def _requested_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int]) -> Check | None:
    """Requested = total x utilization."""
    total, util = facts.get("total_gib"), facts.get("gpu_memory_utilization")
    requested = facts.get("requested_gib")
    if total is None or util is None or requested is None:
        return None
    actual = total * util
    # utilization is the user's exact flag value; only total and requested are rounded
    tol = unit(printed.get("requested_gib")) + unit(printed.get("total_gib")) * util
    return Check(
        "requested", "requested = total x utilization", within(actual, requested, tol),
        f"{total} x {util} = {actual:.3f} GiB against a printed {requested} GiB (tolerance {tol:.3f})",
        formula="total_gib x gpu_memory_utilization", expected=requested, actual=round(actual, 4),
        tolerance=tol, line=lines.get("requested_gib"))


def _non_kv_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int]) -> Check | None:
    """Non-KV = weights + activation peak + non-torch."""
    non_kv = facts.get("non_kv_gib")
    parts = [facts.get(k) for k in NON_KV_PARTS]
    if non_kv is None or None in parts:
        return None
    actual = sum(parts)  # type: ignore[arg-type]
    tol = unit(printed.get("non_kv_gib")) + sum(unit(printed.get(k)) for k in NON_KV_PARTS)
    return Check(
        "non_kv", "non-KV = weights + activation peak + non-torch", within(actual, non_kv, tol),
        f"{' + '.join(str(p) for p in parts)} = {actual:.3f} GiB against a printed {non_kv} GiB (tolerance {tol:.3f})",
        formula="weights_gib + peak_activation_gib + non_torch_gib", expected=non_kv, actual=round(actual, 4),
        tolerance=tol, line=lines.get("non_kv_gib"))


def _kv_remainder_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                        budget: dict[str, Any]) -> Check | None:
    """KV = requested - non-KV on vLLM's budget; not judged where requested was derived from the KV
    pool itself, and matched once the CUDA-graph estimate is subtracted too (v0.21+)."""
    kv = facts.get("kv_cache_gib")
    req_b, non_kv_b = budget["requested_gib"], budget["non_kv_gib"]
    if kv is None or req_b is None or non_kv_b is None:
        return None
    if budget["requested_source"] == "KV pool + non-KV":
        return Check(
            "kv_remainder", "KV = requested - non-KV", None,
            f"requested is not printed; derived as KV {kv} + non-KV {non_kv_b:.2f} = {req_b:.2f} GiB "
            "(give --gpu and --gpu-memory-utilization to judge it)",
            formula="requested_gib - non_kv_gib", expected=kv, actual=round(req_b - non_kv_b, 4),
            line=lines.get("kv_cache_gib"))
    actual = req_b - non_kv_b
    tol = remainder_tolerance(printed)
    graph_note = ""
    ok = within(actual, kv, tol)
    graph = facts.get("cuda_graph_gib")
    if not ok and graph is not None and within(actual - graph, kv, tol + unit(printed.get("cuda_graph_gib"))):
        ok, graph_note = True, f"; matches once the CUDA-graph estimate {graph} GiB is also subtracted (v0.21+)"
    return Check(
        "kv_remainder", "KV = requested - non-KV", ok,
        f"{req_b:.2f} ({budget['requested_source']}) - {non_kv_b:.2f} ({budget['non_kv_source']}) = "
        f"{actual:.3f} GiB against a printed {kv} GiB (tolerance {tol:.3f}){graph_note}",
        formula="requested_gib - non_kv_gib", expected=kv, actual=round(actual, 4), tolerance=tol,
        line=lines.get("kv_cache_gib"))
