"""The whole prefix cache as vLLM's KV events, for a router that starts cold (sglang
#23256 asks for it; vLLM has no such request): :class:`CachedBlockMirror` follows the
batches the publisher sends and answers a snapshot, one ``BlockStored`` per cached
block, every parent before its children (chain order), so a consumer that applies it to
an empty index holds what the cache holds after the last batch sent.

A snapshot is asked on the replay socket (engine/events/exporters/kv_publisher.py) with the start
sequence number ``-2`` (:data:`SNAPSHOT_REQUEST`) instead of a real one; the answer is one
message ``[b"", topic, seq, payload]`` whose ``seq`` is the last batch the snapshot
includes (-1 before any), then the replay's end marker. Live batches after ``seq``
continue it.
"""

from __future__ import annotations

import time

from engine.events.exporters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

SNAPSHOT_REQUEST = (-2).to_bytes(8, "big", signed=True)


class CachedBlockMirror:
    """Every cached block (by group and hash) as the last ``BlockStored`` that named it,
    one block per event, in the order they were stored."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[int | None, int], BlockStored] = {}

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    self._blocks[(event.group_idx, block_hash)] = BlockStored(
                        [block_hash], parent, event.token_ids[i * size:(i + 1) * size], size, event.lora_id,
                        event.medium, event.lora_name, [event.extra_keys[i]] if event.extra_keys else None,
                        event.group_idx, event.kv_cache_spec_kind,
                        event.kv_cache_spec_sliding_window)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop((event.group_idx, block_hash), None)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)

    def snapshot(self, data_parallel_rank: int | None = None) -> EventBatch:
        """Every cached block, parents first (a block whose parent left the cache starts a chain)."""
        children: dict[tuple[int | None, int | None], list[BlockStored]] = {}
        roots: list[BlockStored] = []
        for (group, _), block in self._blocks.items():
            if block.parent_block_hash is not None and (group, block.parent_block_hash) in self._blocks:
                children.setdefault((group, block.parent_block_hash), []).append(block)
            else:
                roots.append(block)
        ordered: list[BlockStored] = []
        stack = list(reversed(roots))
        while stack:
            block = stack.pop()
            ordered.append(block)
            stack.extend(reversed(children.get((block.group_idx, block.block_hashes[0]), [])))
        return EventBatch(ts=time.time(), events=list(ordered), data_parallel_rank=data_parallel_rank)
