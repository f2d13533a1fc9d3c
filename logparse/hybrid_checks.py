"""The KV lines of a hybrid model (sliding-window and full-attention layers in KV cache
groups) reconciled with kvscope's plan of vLLM's hybrid layout: padding layers, tokens,
concurrency."""

from __future__ import annotations

from typing import Any

from engine.budget.memory import GiB, MemoryPlan, plan_memory
from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from logparse.check import Check, unit, within
from logparse.kvscope_plan import kv_dtype, model_dtype


def hybrid_layout(facts: dict[str, Any], model: ModelConfig | None,
                  pool_gib: float | None = None) -> MemoryPlan | None:
    """kvscope's plan of the log's KV pool under vLLM's hybrid layout (the one budget formula,
    engine/budget/memory.py), or None when the model is unknown or attends fully everywhere."""
    max_len = facts.get("max_model_len")
    if model is None or not isinstance(max_len, int) or max_len <= 0:
        return None
    pool = pool_gib if pool_gib is not None else facts.get("kv_cache_gib") or 1.0
    try:
        plan = plan_memory(
            model=model, total_bytes=int(pool * GiB) + 1, gpu_memory_utilization=1.0, max_model_len=max_len,
            block_size=int(facts.get("block_size", 16)), kv_cache_dtype=kv_dtype(facts),
            dtype=model_dtype(facts, model), tensor_parallel_size=int(facts.get("tensor_parallel_size", 1)),
            max_num_batched_tokens=int(facts.get("max_num_batched_tokens", 8192)),
            kv_cache_memory_bytes=int(pool * GiB), check_fits=False)
    except UserError:
        return None
    return plan if plan.is_hybrid else None


def hybrid_checks(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                  plan: MemoryPlan | None, model: ModelConfig | None, tokens_follow: bool = False) -> list[Check]:
    """The KV lines of a hybrid model reconciled with kvscope's plan: the padding vLLM warns of,
    the tokens the printed pool holds, and the concurrency the printed size implies. Where the
    printed tokens are the concurrency's (``tokens_follow``), only the padding is the layout's."""
    if plan is None:
        return [_unreconciled_layout(facts, lines, tokens_follow)]
    layout = _layout_words(plan)
    found = [_padding_check(facts, lines, plan, layout)]
    if not tokens_follow:  # tokens = int(concurrency x max-model-len): per-group blocks are not in them
        found += [_hybrid_tokens_check(facts, printed, lines, plan, model, layout),
                  _hybrid_concurrency_check(facts, printed, lines, plan)]
    return [check for check in found if check is not None]


def _unreconciled_layout(facts: dict[str, Any], lines: dict[str, int], tokens_follow: bool) -> Check:
    """The padding vLLM warns of, unjudged: without the model kvscope has no layout to set beside it."""
    judged = ("the printed tokens are its concurrency x max-model-len, judged as such; pass --model to reconcile "
              "the pool" if tokens_follow else "so the KV size and concurrency follow per-group blocks; pass "
              "--model to reconcile them")
    return Check("hybrid_layout", "hybrid KV layout", None,
                 f"vLLM added {facts.get('padding_layers')} padding layers: its hybrid KV cache manager groups "
                 f"sliding-window and full-attention layers, {judged}", line=lines.get("padding_layers"))


def _layout_words(plan: MemoryPlan) -> str:
    """kvscope's grouping in words: groups, layers per group, windows, page size."""
    windows = sorted({g.sliding_window for g in plan.kv_cache_groups if g.sliding_window})
    return (f"{len(plan.kv_cache_groups)} KV cache groups of at most {plan.layers_per_group} layers (window "
            f"{', '.join(f'{w:,}' for w in windows)}), page {plan.page_size_bytes:,} B")


def _padding_check(facts: dict[str, Any], lines: dict[str, int], plan: MemoryPlan, layout: str) -> Check | None:
    """Padding layers = groups x layers per group - layers, against the count vLLM warns of."""
    padding = facts.get("padding_layers")
    if padding is None:
        return None
    groups = len(plan.kv_cache_groups)
    pad = sum(plan.layers_per_group - len(g.layers) for g in plan.kv_cache_groups)
    return Check(
        "hybrid_padding", "padding layers = groups x G - layers", pad == padding,
        f"kvscope's grouping: {layout}: {groups} x {plan.layers_per_group} - "
        f"{sum(len(g.layers) for g in plan.kv_cache_groups)} layers = {pad} padding layers against a printed {padding}",
        formula="num_groups x layers_per_group - num_layers", expected=padding, actual=pad, tolerance=0,
        line=lines.get("padding_layers"))


def _hybrid_tokens_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int], plan: MemoryPlan,
                         model: ModelConfig | None, layout: str) -> Check | None:
    """The tokens the printed pool holds under the hybrid layout, within the printed GiB's last digit."""
    tokens, kv = facts.get("kv_cache_tokens"), facts.get("kv_cache_gib")
    if kv is None or tokens is None:
        return None
    half = unit(printed.get("kv_cache_gib")) / 2
    lo, mid, hi = (hybrid_layout(facts, model, p) for p in (kv - half, kv, kv + half))
    if lo is None or mid is None or hi is None:
        return None
    tol = max(hi.kv_cache_tokens - mid.kv_cache_tokens, mid.kv_cache_tokens - lo.kv_cache_tokens)
    ok = within(mid.kv_cache_tokens, tokens, tol)
    return Check(
        "hybrid_kv_tokens", "hybrid: tokens = pool // page // G // groups x block", ok,
        f"{kv} GiB / {plan.page_size_bytes:,} B // {plan.layers_per_group} = {mid.num_blocks:,} blocks; "
        f"// {len(plan.kv_cache_groups)} groups x {plan.block_size} = {mid.kv_cache_tokens:,} tokens against a "
        f"printed {tokens:,} (tolerance {tol:,}: the printed GiB's last digit); {layout}",
        formula="kv_cache_gib x 2^30 // page_size // layers_per_group // num_groups x block_size",
        expected=tokens, actual=mid.kv_cache_tokens, tolerance=tol, line=lines.get("kv_cache_tokens"))


def _hybrid_concurrency_check(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                              plan: MemoryPlan) -> Check | None:
    """The concurrency the printed blocks imply: blocks / the blocks one request takes over every group."""
    tokens, conc = facts.get("kv_cache_tokens"), facts.get("max_concurrency")
    exact = facts.get("num_gpu_blocks_info")
    if conc is None or (tokens is None and exact is None):
        return None
    groups = len(plan.kv_cache_groups)
    max_len = facts.get("max_model_len")
    per_request = " + ".join(_per_request_terms(plan))
    if exact is not None:
        n_lo = n_hi = int(exact)
        source = f"{n_lo:,} blocks (num_gpu_blocks)"
    else:
        n_lo = int(tokens) // plan.block_size * groups
        n_hi = n_lo + groups - 1
        source = f"{tokens:,} tokens = {n_lo:,}..{n_hi:,} blocks"
    lo_c, hi_c = n_lo / plan.blocks_per_request, n_hi / plan.blocks_per_request
    actual = (lo_c + hi_c) / 2
    tol = (hi_c - lo_c) / 2 + unit(printed.get("max_concurrency"))
    ok = within(actual, conc, tol)
    full = f"; tokens / max-model-len would say {int(tokens) / max_len:.2f}x" if tokens and max_len else ""
    return Check(
        "hybrid_concurrency", "hybrid: concurrency = blocks / blocks per request", ok,
        f"{source} / {plan.blocks_per_request:,} blocks per {max_len:,}-token request ({per_request}) = "
        f"{actual:.4f} against a printed {printed.get('max_concurrency', conc)}x (tolerance {tol:.4f}){full}",
        formula="num_blocks / sum(blocks_per_request over groups)", expected=conc, actual=round(actual, 4),
        tolerance=tol, line=lines.get("max_concurrency"))


def _per_request_terms(plan: MemoryPlan) -> list[str]:
    """Each spec's blocks per request once, with its group count: '6 x 257 (window 1,024)'."""
    counts: dict[tuple[int | None, int], int] = {}
    for g in plan.kv_cache_groups:
        key = (g.sliding_window, g.blocks_per_request)
        counts[key] = counts.get(key, 0) + 1
    return [(f"{n} x " if n > 1 else "") + f"{blocks:,}" + (f" (window {w:,})" if w else " (full)")
            for (w, blocks), n in counts.items()]
