"""The KV cache coordinator (vLLM V1's ``KVCacheCoordinator``): one single-type manager
per KV cache group (engine/core/single_type_kv_cache.py), all drawing from one
:class:`~engine.core.block_pool.BlockPool`, and the rules that span the groups.

- Prefix hit: the longest prefix every group can serve. Each spec's groups are looked up
  together; the candidate length shrinks until every spec accepts it (a fixed point;
  full attention first, as its scan bounds the rest and its hit is downward closed).
- Allocation: every group's new blocks, and the free cached hit blocks a request takes
  back out of the free queue, are counted against the pool's free blocks at once; a
  request that does not fit changes nothing (window frees aside: they happen first).
- Free: every group's blocks, the whole request's tail first (vLLM frees its groups'
  blocks, in allocation order, reversed).

A model whose layers all attend fully has one group: the same code over a list of one.
The pool's per-block state is keyed by group where it must be (the prefix cache by
(hash, group), as vLLM's ``BlockHashWithGroupId``).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_groups import KVCacheGroup, KVCacheSpec, is_hybrid
from engine.core.request import BlockTables, Request
from engine.core.single_type_kv_cache import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    manager_class,
)

_NO_BLOCKS: list[int] = []  # a table not yet made (read only)


class KVCacheCoordinator:
    """One manager per group over one pool; see the module docstring."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                 enable_caching: bool = True, record_contents: bool = False,
                 max_num_batched_tokens: int = 8192) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.groups = tuple(groups)
        self.specs = tuple(g.spec for g in self.groups)
        # step events name each change's group only when there is more than one table to tell
        # apart (several groups, or a window's null block): one full-attention group's events
        # are what they always were
        self.pool = BlockPool(num_blocks, block_size, enable_caching, record_contents,
                              num_groups=len(self.groups), reserve_null_block=any(s.is_sliding for s in self.specs),
                              grouped_events=is_hybrid(self.groups))
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_class(spec)(spec, g, self.pool) for g, spec in enumerate(self.specs))
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sliding_groups = tuple(g for g, s in enumerate(self.specs) if s.is_sliding)
        self.full_groups = tuple(g for g, s in enumerate(self.specs) if not s.is_sliding)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for g, spec in enumerate(self.specs):
            by_spec.setdefault(spec, []).append(g)
        self.lookup_sets: tuple[tuple[KVCacheSpec, type[SingleTypeKVCacheManager], tuple[int, ...]], ...] = tuple(
            sorted(((spec, manager_class(spec), tuple(ids)) for spec, ids in by_spec.items()),
                   key=lambda item: item[0].is_sliding))
        # one full-attention set and one other: one round settles the fixed point
        self._one_round = len(self.lookup_sets) == 2 and not self.lookup_sets[0][0].is_sliding

    # ------------------------------------------------------------------ lookup
    def empty_tables(self) -> BlockTables:
        return tuple([] for _ in self.managers)

    def find_longest_cache_hit(self, hashes: list[int], max_hit_blocks: int) -> tuple[BlockTables, int]:
        """Each group's hit table for the longest prefix of at most ``max_hit_blocks`` blocks
        that every group serves, and its length in tokens. A window group's table holds
        the null block before its window (a window of a block or less: everywhere)."""
        pool = self.pool
        bs = pool.block_size
        hits: list[list[int]] = [_NO_BLOCKS] * len(self.managers)
        hit_len = max_hit_blocks * bs
        full_len: int | None = None
        while True:
            length = hit_len
            for spec, kind, group_ids in self.lookup_sets:
                if not spec.is_sliding and full_len is not None:
                    length = min(length, full_len)  # downward closed: trim, never look again
                    continue
                found = kind.find_longest_cache_hit(spec, pool, hashes, length // bs, group_ids)
                length = len(found[0]) * bs
                if not spec.is_sliding:
                    full_len = length
                for g, table in zip(group_ids, found, strict=True):
                    hits[g] = table
            if length >= hit_len or self._one_round:
                hit_len = min(hit_len, length)
                break
            hit_len = length
        return self._trim_hits(hits, hit_len), hit_len

    def _trim_hits(self, hits: list[list[int]], hit_len: int) -> BlockTables:
        """Every group's hit cut to ``hit_len``; a window's blocks before its window become the
        null block (never take a block the request would not read)."""
        bs, null = self.pool.block_size, self.pool.null_block
        num = hit_len // bs
        out: list[list[int]] = []
        for spec, group_hit in zip(self.specs, hits, strict=True):
            table = group_hit[:num]
            skipped = min(spec.num_skipped_tokens(hit_len) // bs, num)
            if skipped and null is not None:
                table[:skipped] = [null] * skipped
            out.append(table)
        return tuple(out)

    def full_attention_hit_tokens(self, hashes: list[int], max_hit_blocks: int) -> int | None:
        """The hit the full-attention groups alone would serve, when window groups share the
        pool with them (None otherwise: the hit is then the full groups' own)."""
        if not self.full_groups or not self.sliding_groups:
            return None
        spec = self.specs[self.full_groups[0]]
        found = FullAttentionManager.find_longest_cache_hit(spec, self.pool, hashes, max_hit_blocks, self.full_groups)
        return len(found[0]) * self.pool.block_size

    # -------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, every group."""
        return sum(m.max_blocks(num_tokens, self.max_num_batched_tokens) for m in self.managers)

    def remove_skipped_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Free each window group's blocks wholly before the window of the token after
        ``num_computed_tokens`` (the null block takes their positions)."""
        tables = req.block_tables
        if not tables:
            return
        for g in self.sliding_groups:
            self.managers[g].remove_skipped_blocks(req.request_id, tables[g], num_computed_tokens)

    def num_blocks_to_allocate(self, tables: BlockTables, hits: BlockTables | None, num_slot_blocks: int) -> int:
        """Blocks every group together takes from the free queue for ``num_slot_blocks``
        positions (new ones, and free cached hit blocks)."""
        if hits is None:  # every group's table covers the same positions: each needs as many
            return len(self.managers) * max(0, num_slot_blocks - (len(tables[0]) if tables else 0))
        return sum(manager.num_blocks_to_allocate(tables[g] if tables else _NO_BLOCKS, hits[g], num_slot_blocks)
                   for g, manager in enumerate(self.managers))

    def allocate(self, req: Request, hits: BlockTables | None, num_slot_blocks: int) -> list[int]:
        """Take the hit (an admission) and extend every group's table to ``num_slot_blocks``
        positions; the caller checked the pool holds them. Returns the real blocks appended
        (every group's, group order)."""
        tables = req.block_tables
        if not tables:
            tables = req.block_tables = self.empty_tables()
        managers = self.managers
        if hits is not None:
            # every group's hits first: a later group's new blocks must not evict them
            for manager, table, hit in zip(managers, tables, hits, strict=True):
                manager.take_hit(table, hit)
            req.num_hashed_blocks = len(hits[0])  # hit blocks are registered in the cache already
        record, rid = self.pool.deltas.record_allocated, req.request_id
        appended: list[int] = []
        for g, manager in enumerate(managers):
            new = manager.allocate_new_blocks(tables[g], num_slot_blocks)
            real = new if hits is None else manager.real_blocks(hits[g]) + new
            if real:
                record(rid, g, real)
                appended += real
        return appended

    def cache_full_blocks(self, req: Request, hashes: list[int], num_full_blocks: int) -> None:
        """Register every group's newly full blocks (positions from ``num_hashed_blocks``)."""
        tokens = req.token_ids if self.pool.record_contents else None
        start = req.num_hashed_blocks
        for manager, table in zip(self.managers, req.block_tables, strict=True):
            manager.cache_full_blocks(table, hashes, start, num_full_blocks, tokens)
        req.num_hashed_blocks = num_full_blocks

    # ------------------------------------------------------------------- free
    def free(self, req: Request) -> list[int]:
        """Release every group's blocks, the whole request's tail first. Returns the real
        blocks released (group order, positions in order)."""
        tables = req.block_tables
        if not tables:
            return []
        deltas = self.pool.deltas
        released: list[int] = []
        for g, (manager, table) in enumerate(zip(self.managers, tables, strict=True)):
            real = manager.real_blocks(table)
            if real:
                deltas.record_freed(req.request_id, g, real)
                released.extend(real)
        self.pool.free_blocks(reversed(released))
        req.block_tables = ()
        req.num_hashed_blocks = 0
        return released

    def window_violations(self, req: Request, num_computed_tokens: int) -> list[tuple[int, int]]:
        """(group, position) of each real block a window group holds wholly before the
        window of the token after ``num_computed_tokens``; for tests."""
        tables = req.block_tables
        return [(g, i) for g in self.sliding_groups
                for i in self.managers[g].skipped_positions(num_computed_tokens, tables[g] if tables else _NO_BLOCKS)]
