"""vLLM's answer shapes, written from its source, for tests that decode kvscope's routes
with them: ``KVEventsConfig`` (``vllm/config/kv_events.py``, the values of ``GET
/kv_event_sources``) and ``KVCacheRuntimeInfo`` (``GET /v1/server/kv-cache``,
``vllm/entrypoints/serve/kv_cache/protocol.py`` of vLLM PR #43793: the two group specs
kvscope has). ``extra="forbid"``: a field vLLM does not have fails the decode."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class VllmKVEventsConfig(BaseModel):
    """vllm/config/kv_events.py's fields, and no others."""

    model_config = ConfigDict(extra="forbid")
    enable_kv_cache_events: bool
    publisher: Literal["null", "zmq"]
    endpoint: str
    replay_endpoint: str | None
    buffer_steps: int
    hwm: int
    max_queue_size: int
    topic: str


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_id: int
    layer_names: list[str]
    block_size: int
    page_size_bytes: int
    num_kv_heads: int
    head_size: int
    dtype: str


class FullAttentionGroupSpec(_Group):
    spec_type: Literal["FullAttentionSpec"]
    head_size_v: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


class SlidingWindowGroupSpec(_Group):
    spec_type: Literal["SlidingWindowSpec"]
    sliding_window: int


class KVCacheRuntimeInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_cache_size_tokens: int | None = None
    max_concurrency: float | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    groups: list[Annotated[FullAttentionGroupSpec | SlidingWindowGroupSpec, Field(discriminator="spec_type")]]
