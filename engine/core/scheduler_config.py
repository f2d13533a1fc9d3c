"""The scheduler's limits (:class:`SchedulerConfig`), under vLLM's flag names; read by the
scheduler (engine/core/scheduler.py, which re-exports it), startup, the simulator and replay."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.core.kv_cache_groups import KVCacheGroup, groups_from_config
from engine.core.policy import POLICIES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits, under vLLM's flag names."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off
    # kvscope's: the budget of a step in which a running request decodes (0 = off: every
    # step gets max_num_batched_tokens, as in vLLM); see the module docstring
    max_decode_step_tokens: int = 0
    policy: str = "fcfs"  # fcfs | priority
    # vision-language models (engine/core/encoder_cache.py): embeddings the encoder may
    # produce per step and the cache may hold; 0 = a text model
    encoder_compute_budget: int = 0
    encoder_cache_size: int = 0
    # vLLM's KVEventsConfig.enable_kv_cache_events: step events carry each cached block's
    # hash, parent hash and token ids and each evicted block's hash (the KV events sink's facts)
    enable_kv_cache_events: bool = False
    # the model's KV cache groups (engine/core/kv_cache_groups.py); () = one full-attention
    # group (kv_cache_groups.resolve_groups)
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()

    @classmethod
    def from_flags(
        cls, flags: Mapping[str, Any], *, num_blocks: int, block_size: int | None = None,
        max_model_len: int | None = None,
    ) -> SchedulerConfig:
        """From engine flags under vLLM's names: an EngineConfig's ``to_dict()`` or a
        recording header's config (``kv_cache_groups``: ``engine.config``'s, a hybrid
        model's groups). Missing flags take the defaults above."""
        defaults = cls(num_blocks=1)
        return cls(
            num_blocks=int(num_blocks),
            block_size=int(block_size or flags.get("block_size") or defaults.block_size),
            max_num_seqs=int(flags.get("max_num_seqs") or defaults.max_num_seqs),
            max_num_batched_tokens=int(flags.get("max_num_batched_tokens") or defaults.max_num_batched_tokens),
            max_model_len=int(max_model_len or flags.get("max_model_len") or defaults.max_model_len),
            enable_prefix_caching=bool(flags.get("enable_prefix_caching", defaults.enable_prefix_caching)),
            long_prefill_token_threshold=int(flags.get("long_prefill_token_threshold") or 0),
            max_decode_step_tokens=int(flags.get("max_decode_step_tokens") or 0),
            policy=str(flags.get("scheduling_policy") or flags.get("policy") or defaults.policy),
            enable_kv_cache_events=bool((flags.get("kv_events_config") or {}).get("enable_kv_cache_events")),
            kv_cache_groups=groups_from_config(flags.get("kv_cache_groups")),
        )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_decode_step_tokens < 0:
            raise ValueError(f"max_decode_step_tokens must be positive (0: off), got {self.max_decode_step_tokens}")
