"""One KV cache group's rules (vLLM V1's ``SingleTypeKVCacheManager``): which blocks of a
request's table the group keeps, which cached blocks a prefix hit may reuse, and which
blocks it gives back before the request ends.

Every group draws from the one shared :class:`~engine.core.block_pool.BlockPool`; a
request's table for group ``g`` is ``Request.block_tables[g]`` (positions in order), and
:class:`~engine.core.kv_cache_coordinator.KVCacheCoordinator` drives one manager per
group. The kind follows the group's :class:`~engine.core.kv_cache_groups.KVCacheSpec`:

- :class:`FullAttentionManager` keeps every block until the request finishes; its
  prefix hit is the leftmost run of cached blocks (downward closed: a hit of ``n``
  blocks holds every shorter one).
- :class:`SlidingWindowManager` (a window of ``W`` tokens) frees the blocks wholly
  before the window of the next token to compute each time the request is scheduled,
  before its new blocks are taken (vLLM's ``remove_skipped_blocks``: fewer evictions);
  the table keeps its length, the pool's null block standing at the freed positions.
  Its hit needs only the ``ceil((W - 1) / block_size)`` blocks before the hit's end, found
  by scanning from the right; the positions before them get the null block.

Groups of one spec are looked up together (a hash hits only when every one of them holds
it), so the lookups are class methods over a set of group ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import BlockPool, StoredRun
from engine.core.kv_cache_groups import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cached_in_all(pool: BlockPool, block_hash: int, group_ids: Sequence[int]) -> list[int] | None:
    """The block of each group holding ``block_hash``, or None unless all of them do."""
    maps = pool.cached_block_maps
    out: list[int] = []
    for g in group_ids:
        b = maps[g].get(block_hash)
        if b is None:
            return None
        out.append(b)
    return out


class SingleTypeKVCacheManager:
    """The tables of one KV cache group over the shared pool; see the module docstring."""

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = pool.block_size
        self.null_block = pool.null_block

    @classmethod
    def find_longest_cache_hit(cls, spec: KVCacheSpec, pool: BlockPool, hashes: Sequence[int], max_blocks: int,
                               group_ids: Sequence[int]) -> list[list[int]]:
        """Each group's hit table for at most ``max_blocks`` blocks of ``hashes``."""
        raise NotImplementedError

    def max_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once in this group."""
        return self.spec.max_blocks(num_tokens, self.block_size, max_num_batched_tokens)

    def remove_skipped_blocks(self, request_id: str, table: list[int], num_computed_tokens: int) -> None:
        """Free the blocks no later token reads (none for full attention)."""

    def skipped_positions(self, num_computed_tokens: int, table: list[int]) -> list[int]:
        """Positions of ``table`` holding a real block that no token after
        ``num_computed_tokens`` reads (none for full attention); for tests."""
        return []

    def real_blocks(self, blocks: list[int]) -> list[int]:
        """``blocks`` without the null block (the list itself when the pool has none)."""
        null = self.null_block
        return blocks if null is None else [b for b in blocks if b != null]

    def num_blocks_to_allocate(self, table: list[int], hit: list[int] | None, num_slot_blocks: int) -> int:
        """Blocks this group takes from the free queue to cover ``num_slot_blocks`` positions:
        new ones, and the free cached blocks of a prefix hit (they leave the queue too)."""
        held = len(table)
        needed = 0
        if hit is not None:
            held += len(hit)
            ref_cnt, null = self.pool.ref_cnt, self.null_block
            needed = sum(1 for b in hit if b != null and ref_cnt[b] == 0)
        return needed + max(0, num_slot_blocks - held)

    def take_hit(self, table: list[int], hit: list[int]) -> None:
        """Append a prefix hit to an empty table, taking a reference on its real blocks."""
        self.pool.touch(self.real_blocks(hit))
        table.extend(hit)

    def allocate_new_blocks(self, table: list[int], num_slot_blocks: int) -> list[int]:
        """Extend ``table`` with new blocks up to ``num_slot_blocks`` positions."""
        if len(table) >= num_slot_blocks:
            return []
        new = self.pool.get_new_blocks(num_slot_blocks - len(table))
        table.extend(new)
        return new

    def cache_full_blocks(self, table: list[int], hashes: list[int], start: int, num_full: int,
                          tokens: list[int] | None) -> None:
        """Register the table's blocks at positions ``start .. num_full - 1`` under their
        hashes (not the null block, not a block hashed already). With ``tokens`` (contents
        recorded) one stored run of consecutive new blocks, cut where a block is not cached
        by this request (already hashed, or its content held by another block)."""
        pool, g = self.pool, self.group_id
        block_hash, null = pool.block_hash, self.null_block
        run: StoredRun | None = None
        run_start = 0  # the run's first position; its tokens are one slice once it ends
        bs = self.block_size
        for i in range(start, num_full):
            b = table[i]
            if b != null and block_hash[b] is None:
                if tokens is not None and run is None:
                    run, run_start = pool.deltas.start_run(hashes[i - 1] if i else None, g), i
                if pool.cache_block(b, hashes[i], run, g):
                    continue
            if run is not None:
                assert tokens is not None
                run.token_ids = tokens[run_start * bs : i * bs]
                run = None
        if run is not None:
            assert tokens is not None
            run.token_ids = tokens[run_start * bs : num_full * bs]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block until the request finishes; hits from the left."""

    @classmethod
    def find_longest_cache_hit(cls, spec: KVCacheSpec, pool: BlockPool, hashes: Sequence[int], max_blocks: int,
                               group_ids: Sequence[int]) -> list[list[int]]:
        if len(group_ids) == 1:  # the common case: one dict lookup per block
            lookup = pool.cached_block_maps[group_ids[0]].get
            hit: list[int] = []
            for i in range(max_blocks):
                b = lookup(hashes[i])
                if b is None:
                    break
                hit.append(b)
            return [hit]
        hits: list[list[int]] = [[] for _ in group_ids]
        for i in range(max_blocks):
            found = cached_in_all(pool, hashes[i], group_ids)
            if found is None:
                break
            for table, b in zip(hits, found, strict=True):
                table.append(b)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """The blocks inside the window; hits from the right."""

    @classmethod
    def find_longest_cache_hit(cls, spec: KVCacheSpec, pool: BlockPool, hashes: Sequence[int], max_blocks: int,
                               group_ids: Sequence[int]) -> list[list[int]]:
        """vLLM's ``SlidingWindowManager.find_longest_cache_hit``: from the right, the first
        run of ``ceil((W - 1) / bs)`` consecutive cached blocks ends the hit; with none, the
        run of cached blocks at the very start (shorter than the window) does."""
        assert spec.sliding_window is not None
        null = pool.null_block
        assert null is not None
        needed = cdiv(spec.sliding_window - 1, pool.block_size)
        hits: list[list[int]] = [[null] * max_blocks for _ in group_ids]
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            found = cached_in_all(pool, hashes[i], group_ids)
            if found is None:
                run = 0
                continue
            for table, b in zip(hits, found, strict=True):
                table[i] = b
            run += 1
            if run >= needed:
                for table in hits:
                    del table[i + run :]
                return hits
        for table in hits:
            del table[run:]
        return hits

    def _num_skipped(self, num_computed_tokens: int) -> int:
        return self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size

    def remove_skipped_blocks(self, request_id: str, table: list[int], num_computed_tokens: int) -> None:
        """Walks back from the last skipped position and stops at the first null block
        (everything before it was freed by an earlier call)."""
        null = self.null_block
        assert null is not None  # a pool with a window group reserves it
        removed: list[int] = []
        for i in range(min(self._num_skipped(num_computed_tokens), len(table)) - 1, -1, -1):
            b = table[i]
            if b == null:
                break
            removed.append(b)
            table[i] = null
        if removed:
            self.pool.free_blocks(removed)
            self.pool.deltas.record_window_freed(request_id, self.group_id, removed)

    def skipped_positions(self, num_computed_tokens: int, table: list[int]) -> list[int]:
        null = self.null_block
        return [i for i in range(min(self._num_skipped(num_computed_tokens), len(table))) if table[i] != null]


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager kind for a group of ``spec`` (vLLM's ``get_manager_for_kv_cache_spec``)."""
    return SlidingWindowManager if spec.is_sliding else FullAttentionManager
