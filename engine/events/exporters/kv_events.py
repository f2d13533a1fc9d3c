"""vLLM's KV cache events as a fold of kvscope's events: each ``step`` event that
changed the prefix cache becomes one ``EventBatch`` in vLLM's wire format
(``vllm/distributed/kv_events.py``), the format llm-d's KV-cache indexer, NVIDIA
Dynamo, kthena and aibrix consume.

Wire format (msgpack, encoded with msgspec): a batch is positional,
``[ts, events, data_parallel_rank]``; each event is a map tagged with ``"type"``
(vLLM's encoding since mid-2026, vllm-project/vllm#42892):

- ``BlockStored`` {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window}: consecutive blocks of one request that entered the
  prefix cache (became full and hashed), ``parent_block_hash`` the hash of the block
  before the first (null for a prompt's first block), ``token_ids`` all their tokens;
- ``BlockRemoved`` {block_hashes, medium, group_idx}: hashes evicted from the cache;
- ``AllBlocksCleared`` {}: vLLM's prefix-cache reset (kvscope has no reset path, so
  the fold never produces it; the type is here so the format is whole).

Every field is written (vLLM omits those at their default, so its consumers accept
both). The structs are not tracked by Python's garbage collector (as vLLM's), which
would otherwise scan every batch a busy step loop makes. Within a batch removals come first: the step event's evictions are folded
before its stores, which reproduces the cache even when a block is evicted and
re-filled in one step.

Hashes: kvscope's block hash is Python's hash of ``(parent hash, token ids)``
(engine/core/kv_cache.py), a signed 64-bit integer; it is published as the unsigned
64-bit integer with the same bits, as vLLM publishes its (sha256-derived) hashes as
u64 integers. Equal prefixes give equal hashes within kvscope, never equal to vLLM's.
``medium`` is ``"GPU"`` on CUDA (and in ``engine simulate``) and ``"CPU"`` on CPU,
read from phase A's ``device``; ``block_size`` from ``engine.config``.

The KV cache (engine/core/kv_cache_coordinator.py) caches each group's blocks under
(hash, group), as vLLM does: a ``BlockStored`` names its run's ``group_idx`` and that
group's spec (``kv_cache_spec_kind`` ``"full_attention"`` or ``"sliding_window"``,
``kv_cache_spec_sliding_window`` the window), read from ``engine.config``'s
``kv_cache_groups``; removals are one ``BlockRemoved`` per group. A stream that names no
groups is one full-attention group 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from engine.events import EngineConfigEvent, Event, StartupPhase, StepEvent
from engine.events.phase_data import InitData, read_phase

U64_MASK = (1 << 64) - 1
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
KV_CACHE_SPEC_KIND = "full_attention"  # vLLM's kind of a full-attention group (a stream without kv_cache_groups)
DEFAULT_BLOCK_SIZE = 16  # a stream without engine.config (kvscope's and vLLM's default)


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # wall-clock seconds since the epoch, as vLLM's time.time()
    events: list[KVCacheEvent]
    data_parallel_rank: int | None


def external_hash(block_hash: int) -> int:
    """kvscope's signed 64-bit block hash as the u64 vLLM's consumers read."""
    return block_hash & U64_MASK


def medium_of(device: str | None) -> str:
    return MEDIUM_CPU if device is not None and device.startswith("cpu") else MEDIUM_GPU


class KVEventFold:
    """Events in, vLLM ``EventBatch`` out: :meth:`apply` returns the batch a step
    event makes (None for any other event and for a step that changed no cached
    block). The device and block size come from the stream's own events."""

    def __init__(self, data_parallel_rank: int = 0, clock: Callable[[], float] = time.time) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.block_size = DEFAULT_BLOCK_SIZE
        self.medium = MEDIUM_GPU
        # each KV cache group's (kind, sliding window), from engine.config; none: one full group
        self.group_specs: list[tuple[str, int | None]] = []
        self._clock = clock

    def group_spec(self, group: int) -> tuple[str, int | None]:
        specs = self.group_specs
        return specs[group] if group < len(specs) else (KV_CACHE_SPEC_KIND, None)

    def apply(self, event: Event) -> EventBatch | None:
        if isinstance(event, StepEvent):
            if not event.cached_runs and not event.evicted_hashes:
                return None
            return EventBatch(ts=self._clock(), events=self.step_events(event),
                              data_parallel_rank=self.data_parallel_rank)
        if isinstance(event, EngineConfigEvent):
            self.block_size = int(event.config.get("block_size") or DEFAULT_BLOCK_SIZE)
            self.group_specs = [(str(g.get("kind") or KV_CACHE_SPEC_KIND),
                                 int(g["sliding_window"]) if g.get("sliding_window") else None)
                                for g in event.config.get("kv_cache_groups") or ()]
        elif isinstance(event, StartupPhase) and event.phase == "A" and event.status == "end":
            init = read_phase(event, InitData)
            if init is not None and init.device is not None:
                self.medium = medium_of(init.device)
        return None

    def step_events(self, step: StepEvent) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        if step.evicted_hashes:
            # one BlockRemoved per group, in the order each group first lost a block (a step
            # that names no groups: group 0's)
            groups = step.evicted_groups or [0] * len(step.evicted_hashes)
            by_group: dict[int, list[int]] = {}
            for h, group in zip(step.evicted_hashes, groups, strict=True):
                by_group.setdefault(group, []).append(h & U64_MASK)
            events.extend(BlockRemoved(block_hashes=hashes, medium=self.medium, group_idx=group)
                          for group, hashes in by_group.items())
        for run in step.cached_runs:  # one request's consecutive blocks: one BlockStored
            parent = run["parent_hash"]
            hashes = run["hashes"]
            group = int(run.get("group_idx") or 0)
            kind, window = self.group_spec(group)
            events.append(BlockStored(
                block_hashes=[h & U64_MASK for h in hashes],  # external_hash, inline: the hot loop
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=run["token_ids"],
                block_size=self.block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                extra_keys=[None] * len(hashes),  # no multimodal inputs, LoRA or cache salt enter kvscope's hash
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            ))
        return events
