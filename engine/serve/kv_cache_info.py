"""``GET /v1/server/kv-cache`` (experimental): the KV cache as the engine runs it, in the
shape of vLLM's ``KVCacheRuntimeInfo`` (vLLM PR #43793, not merged yet, so the shape may
still move): the pool's blocks and tokens, the concurrency it holds at ``--max-model-len``,
and one entry per KV cache group (engine/core/kv_cache_groups.py) with its ``spec_type``
(``FullAttentionSpec`` or ``SlidingWindowSpec``), layers, block size, one layer's page of
bytes and ``sliding_window``. A full-attention model has one group; Gemma 3's hybrid
layout shows its sliding groups beside the full one. Read from startup's result (under
data parallelism rank 0's: every rank runs the same model and flags)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.core.kv_cache_groups import KVCacheGroup, resolve_groups
from engine.modelspec.kv_cache_dtypes import KV_CACHE_DTYPES
from engine.serve.route_support import KEYED, host_of

router = APIRouter()

FULL_ATTENTION_SPEC = "FullAttentionSpec"
SLIDING_WINDOW_SPEC = "SlidingWindowSpec"


def kv_cache_runtime_info(startup: Any) -> dict[str, Any]:
    """vLLM's ``KVCacheRuntimeInfo`` of a started engine (``LLMEngine.startup`` or a data-
    parallel core's facts: ``config``, ``model_config``, ``scheduler_config``, ``plan``)."""
    config, model, limits, plan = startup.config, startup.model_config, startup.scheduler_config, startup.plan
    groups = resolve_groups(limits.kv_cache_groups)
    tp = max(1, int(getattr(config, "tensor_parallel_size", 1) or 1))
    kv_heads = max(1, model.num_kv_heads // tp)
    # "auto" after startup: stored in the model's dtype (resolved too)
    dtype = KV_CACHE_DTYPES[str(config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)]
    # one layer's block: K and V of each token slot and KV head (vLLM's page_size_bytes), int8's scales too
    page = 2 * limits.block_size * kv_heads * (model.head_dim * dtype.element_bytes + dtype.scale_bytes)
    return {
        "kv_cache_size_tokens": int(plan.kv_cache_tokens),
        "max_concurrency": float(plan.max_concurrency),
        "num_gpu_blocks": int(limits.num_blocks),
        "num_cpu_blocks": None,  # no second tier (see --kv-offloading-size)
        "groups": [_group(i, g, model.num_layers, limits.block_size, page, kv_heads, model.head_dim, dtype.name)
                   for i, g in enumerate(groups)],
    }


def _group(index: int, group: KVCacheGroup, num_layers: int, block_size: int, page: int, kv_heads: int,
           head_size: int, dtype: str) -> dict[str, Any]:
    """One group as vLLM's ``FullAttentionGroupSpec`` or ``SlidingWindowGroupSpec``."""
    layers = group.layers or tuple(range(num_layers))  # () stands for every layer (one full-attention group)
    entry: dict[str, Any] = {
        "group_id": index, "layer_names": [f"model.layers.{i}.self_attn" for i in layers],
        "block_size": block_size, "page_size_bytes": page, "num_kv_heads": kv_heads, "head_size": head_size,
        "dtype": dtype, "sliding_window": group.spec.sliding_window,
    }
    if group.spec.is_sliding:
        return {"spec_type": SLIDING_WINDOW_SPEC, **entry}
    return {"spec_type": FULL_ATTENTION_SPEC, **entry, "head_size_v": head_size, "attention_chunk_size": None}


@router.get("/v1/server/kv-cache", dependencies=KEYED)
async def kv_cache(request: Request) -> dict[str, Any]:
    """The KV cache in force (module docstring)."""
    return kv_cache_runtime_info(host_of(request).llm.startup)
