"""The hybrid KV cache manager: one block table per KV cache group over one shared pool
(vLLM V1's ``HybridKVCacheCoordinator`` with its full-attention and sliding-window
managers).

Each request holds one table per group (``Request.group_block_ids``, positions in
order; ``block_ids`` is group 0's), every table drawn from one
:class:`~engine.core.block_pool.BlockPool`. Per group, by its spec:

- full attention keeps every block until the request finishes;
- a sliding window of ``W`` tokens frees the blocks that lie wholly before the window
  of the next token to compute (``num_computed - W + 1`` tokens are skipped) each time
  the request is scheduled, before its new blocks are taken (vLLM's
  ``remove_skipped_blocks``: fewer evictions); the table keeps its length, the null
  block standing at the freed positions.

Admission counts the new blocks of every group (and the free cached hit blocks a
request takes back out of the free queue) against the pool's free blocks; a request
that does not fit changes nothing. Preemption and finishing free every group's blocks.

Prefix caching: block hashes are the request's one chain (engine/core/kv_cache.py), a
group's cached blocks are keyed by (hash, group). The hit is the longest prefix every
group can serve: full attention scans from the left and its hit is downward closed; a
window needs only the ``ceil((W - 1) / block_size)`` blocks before the hit's end, so it
scans from the right for that many consecutive cached blocks (the positions before them
get the null block); groups of one spec are looked up together (a hash hits only when
every one of them holds it). The coordinator shrinks the candidate length until every
spec accepts it (a fixed point; full attention first, as its scan bounds the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.core.block_pool import BlockDeltas, BlockPool
from engine.core.kv_cache import KVCacheManager, cdiv, extend_block_hashes, prefix_stop
from engine.core.kv_cache_groups import KVCacheGroup, KVCacheSpec, is_hybrid
from engine.core.request import Request
from engine.events.schema import PREFIX_WINDOW


class KVCache(Protocol):
    """What the scheduler asks of a KV cache manager (single-group or hybrid)."""

    pool: BlockPool
    block_size: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    enable_caching: bool
    last_shortfall: tuple[int, int]  # (blocks needed, blocks free) of the last allocation refused

    def get_computed_blocks(self, req: Request) -> tuple[Any, int]: ...
    def record_lookup(self, num_tokens: int, hit_tokens: int) -> None: ...
    def explain_hit(self, req: Request, hit_tokens: int) -> list[Any]: ...
    def can_ever_fit(self, num_tokens: int) -> bool: ...
    def blocks_needed(self, num_tokens: int) -> int: ...
    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Any = None,
                       num_computed_hit_tokens: int = 0) -> list[int] | None: ...
    def free(self, req: Request) -> list[int]: ...
    def take_deltas(self) -> BlockDeltas: ...

    @property
    def usage(self) -> float: ...

    @property
    def prefix_hit_rate(self) -> float: ...


class HybridKVCacheManager:
    """Per-group block tables over one :class:`BlockPool`; see the module docstring."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                 enable_caching: bool = True, record_block_contents: bool = False,
                 max_num_batched_tokens: int = 8192) -> None:
        if not groups:
            raise ValueError("a hybrid KV cache needs at least one group")
        self.groups = tuple(groups)
        self.specs = tuple(g.spec for g in self.groups)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.record_block_contents = record_block_contents
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = BlockPool(num_blocks, block_size, enable_caching, record_block_contents,
                              num_groups=len(self.groups), reserve_null_block=any(s.is_sliding for s in self.specs),
                              group_deltas=True)
        self.null_block = self.pool.null_block
        self.sliding_groups = tuple(i for i, s in enumerate(self.specs) if s.is_sliding)
        # groups of one spec are looked up together; full attention first (its scan bounds the rest)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for i, spec in enumerate(self.specs):
            by_spec.setdefault(spec, []).append(i)
        self.lookup_sets: tuple[tuple[KVCacheSpec, tuple[int, ...]], ...] = tuple(
            sorted(((spec, tuple(ids)) for spec, ids in by_spec.items()), key=lambda item: item[0].is_sliding))
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.last_shortfall = (0, 0)

    # ------------------------------------------------------------------ hashing
    def _extend_block_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        return extend_block_hashes(req, num_full_blocks, self.block_size)

    # ------------------------------------------------------------------ lookup
    def _cached(self, block_hash: int, group_ids: tuple[int, ...]) -> list[int] | None:
        """The block of each group holding ``block_hash``, or None unless all do."""
        maps = self.pool.cached_block_maps
        out: list[int] = []
        for g in group_ids:
            b = maps[g].get(block_hash)
            if b is None:
                return None
            out.append(b)
        return out

    def _full_hit(self, hashes: list[int], max_blocks: int, group_ids: tuple[int, ...]) -> list[list[int]]:
        hits: list[list[int]] = [[] for _ in group_ids]
        for i in range(max_blocks):
            found = self._cached(hashes[i], group_ids)
            if found is None:
                break
            for table, b in zip(hits, found, strict=True):
                table.append(b)
        return hits

    def _window_hit(self, hashes: list[int], max_blocks: int, spec: KVCacheSpec,
                    group_ids: tuple[int, ...]) -> list[list[int]]:
        """vLLM's ``SlidingWindowManager.find_longest_cache_hit``: from the right, the
        first run of ``ceil((W - 1) / bs)`` consecutive cached blocks ends the hit; with
        none, the run of cached blocks at the very start (shorter than the window) does."""
        assert spec.sliding_window is not None
        null = self.null_block
        assert null is not None
        needed = cdiv(spec.sliding_window - 1, self.block_size)
        hits: list[list[int]] = [[null] * max_blocks for _ in group_ids]
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            found = self._cached(hashes[i], group_ids)
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

    def get_computed_blocks(self, req: Request) -> tuple[list[list[int]] | None, int]:
        """Longest prefix every group can serve: (per-group hit tables, hit tokens).

        A sliding-window group's hit table holds the null block before its window.
        Never the whole sequence: the last token is always recomputed. Statistics are
        not touched here; see :meth:`record_lookup`."""
        if not self.enable_caching:
            return None, 0
        bs = self.block_size
        max_hit_blocks = (len(req.token_ids) - 1) // bs
        hashes = self._extend_block_hashes(req, max_hit_blocks)
        hits: list[list[int] | None] = [None] * len(self.groups)
        hit_len = max_hit_blocks * bs
        full_len: int | None = None
        simple = len(self.lookup_sets) == 2 and not self.lookup_sets[0][0].is_sliding
        while True:
            length = hit_len
            for spec, group_ids in self.lookup_sets:
                if not spec.is_sliding and full_len is not None:
                    length = min(length, full_len)  # downward closed: trim, never look again
                    continue
                found = (self._window_hit(hashes, length // bs, spec, group_ids) if spec.is_sliding
                         else self._full_hit(hashes, length // bs, group_ids))
                length = len(found[0]) * bs
                if not spec.is_sliding:
                    full_len = length
                for g, table in zip(group_ids, found, strict=True):
                    hits[g] = table
            if length >= hit_len:
                break
            hit_len = length
            if simple:  # one full-attention set and one other: one round settles it
                break
        num = hit_len // bs
        out: list[list[int]] = []
        for spec, group_hit in zip(self.specs, hits, strict=True):
            assert group_hit is not None
            table = group_hit[:num]
            # a window of a block or less needs none of the hit's blocks: never take one it would not read
            skipped = min(spec.num_skipped_tokens(hit_len) // bs, num)
            if skipped and self.null_block is not None:
                table[:skipped] = [self.null_block] * skipped
            out.append(table)
        return out, hit_len

    def record_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup, in tokens (queries, hits)."""
        if not self.enable_caching:
            return
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += hit_tokens
        deltas = self.pool.deltas
        deltas.prefix_query_tokens += num_tokens
        deltas.prefix_hit_tokens += hit_tokens

    def explain_hit(self, req: Request, hit_tokens: int) -> list[Any]:
        """Where the lookup that hit ``hit_tokens`` stopped and why (:func:`prefix_stop`); a
        hit shorter than the full-attention groups alone would serve stopped at a sliding
        window (it lacked the blocks just before the hit's end)."""
        bs = self.block_size
        full_ids = tuple(g for g, spec in enumerate(self.specs) if not spec.is_sliding)
        if full_ids and self.sliding_groups:
            max_blocks = (len(req.token_ids) - 1) // bs
            full_tokens = len(self._full_hit(req.block_hashes, max_blocks, full_ids)[0]) * bs
            if full_tokens > hit_tokens:
                return [hit_tokens, PREFIX_WINDOW, full_tokens]
        return prefix_stop(req, hit_tokens, bs, self.pool)

    # -------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, every group."""
        bs, chunk = self.block_size, self.max_num_batched_tokens
        return sum(spec.max_blocks(num_tokens, bs, chunk) for spec in self.specs)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_usable

    def remove_skipped_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Free each sliding-window group's blocks that lie wholly before the window of
        the token after ``num_computed_tokens``; the null block takes their positions.
        Walks back from the last skipped position and stops at the first null (everything
        before it was freed by an earlier call)."""
        null = self.null_block
        tables = req.group_block_ids
        if not tables or null is None:
            return
        deltas = self.pool.deltas
        bs = self.block_size
        for g in self.sliding_groups:
            skipped = self.specs[g].num_skipped_tokens(num_computed_tokens) // bs
            table = tables[g]
            removed: list[int] = []
            for i in range(min(skipped, len(table)) - 1, -1, -1):
                b = table[i]
                if b == null:
                    break
                removed.append(b)
                table[i] = null
            if removed:
                self.pool.free_blocks(removed)
                deltas.record_window_freed(req.request_id, g, removed)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[list[int]] | None = None,
        num_computed_hit_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req`` in every group.

        ``computed_blocks`` / ``num_computed_hit_tokens`` are a prefix hit from
        :meth:`get_computed_blocks` for a request being admitted. Window blocks the
        request no longer reads are freed first, even when the rest does not fit.
        Returns the real blocks appended (every group's, group order) or None, changing
        nothing else, when the pool cannot supply them. Full blocks among the tokens
        known after this step enter the prefix cache now, as in
        :class:`~engine.core.kv_cache.KVCacheManager`."""
        pool = self.pool
        bs = self.block_size
        null = self.null_block
        num_groups = len(self.groups)
        if self.sliding_groups and req.num_computed_tokens:
            self.remove_skipped_blocks(req, req.num_computed_tokens)
        tables = req.group_block_ids
        computed = req.num_computed_tokens + num_computed_hit_tokens
        num_slots_blocks = cdiv(computed + num_new_tokens, bs)
        hits = computed_blocks if computed_blocks else None
        ref_cnt = pool.ref_cnt
        num_needed = 0
        for g in range(num_groups):
            held = len(tables[g]) if tables else 0
            if hits is not None:
                held += len(hits[g])
                num_needed += sum(1 for b in hits[g] if b != null and ref_cnt[b] == 0)
            num_needed += max(0, num_slots_blocks - held)
        if num_needed > pool.num_free:
            self.last_shortfall = (num_needed, pool.num_free)
            return None
        if not tables:
            tables = req.group_block_ids = tuple([] for _ in range(num_groups))
            req.block_ids = tables[0]
        deltas = pool.deltas
        appended: list[int] = []
        if hits is not None:
            for g in range(num_groups):  # every group's hits first: a later group's new blocks must not evict them
                real = [b for b in hits[g] if b != null]
                pool.touch(real)
                tables[g].extend(hits[g])
            req.num_hashed_blocks = len(hits[0])  # hit blocks are registered in the cache already
        for g in range(num_groups):
            table = tables[g]
            new = pool.get_new_blocks(num_slots_blocks - len(table)) if len(table) < num_slots_blocks else []
            table.extend(new)
            real = [b for b in hits[g] if b != null] + new if hits is not None else new
            if real:
                deltas.record_allocated(req.request_id, g, real)
                appended.extend(real)
        if self.enable_caching:
            num_tokens = len(req.token_ids)
            known = computed + num_new_tokens
            num_full = (known if known < num_tokens else num_tokens) // bs
            if num_full > req.num_hashed_blocks:
                self._cache_full_blocks(req, num_full)
        return appended

    def _cache_full_blocks(self, req: Request, num_full_blocks: int) -> None:
        """Register each group's newly full blocks (not the null block, not a block
        hashed already); with contents recorded, one stored run per group of the
        request's consecutive new blocks, cut where a block is not cached by it."""
        hashes = self._extend_block_hashes(req, num_full_blocks)
        pool = self.pool
        block_hash = pool.block_hash
        null = self.null_block
        tokens, bs = req.token_ids, self.block_size
        record = self.record_block_contents
        start_pos = req.num_hashed_blocks
        for g, table in enumerate(req.group_block_ids):
            run = None
            start = 0
            for i in range(start_pos, num_full_blocks):
                b = table[i]
                if b != null and block_hash[b] is None:
                    if record and run is None:
                        run, start = pool.deltas.start_run(hashes[i - 1] if i else None, g), i
                    if pool.cache_block(b, hashes[i], run, g):
                        continue
                if run is not None:
                    run.token_ids = tokens[start * bs : i * bs]
                    run = None
            if run is not None:
                run.token_ids = tokens[start * bs : num_full_blocks * bs]
        req.num_hashed_blocks = num_full_blocks

    # ------------------------------------------------------------------- free
    def free(self, req: Request) -> list[int]:
        """Release every group's blocks, the whole request's tail first (vLLM frees its
        groups' blocks, in allocation order, reversed). Returns the real blocks released
        (group order, positions in order)."""
        tables = req.group_block_ids
        if not tables:
            return []
        null = self.null_block
        deltas = self.pool.deltas
        released: list[int] = []
        for g, table in enumerate(tables):
            real = [b for b in table if b != null]
            if real:
                deltas.record_freed(req.request_id, g, real)
                released.extend(real)
        self.pool.free_blocks(reversed(released))
        req.group_block_ids = ()
        req.block_ids = []
        req.num_hashed_blocks = 0
        return released

    # ------------------------------------------------------------------ state
    def take_deltas(self) -> BlockDeltas:
        """Hand over the block changes recorded so far and start a new record."""
        return self.pool.take_deltas()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def window_violations(self, req: Request, num_computed_tokens: int) -> list[tuple[int, int]]:
        """(group, position) of each real block a sliding-window group holds wholly before
        the window of the token after ``num_computed_tokens``; for tests."""
        out: list[tuple[int, int]] = []
        for g in self.sliding_groups:
            skipped = self.specs[g].num_skipped_tokens(num_computed_tokens) // self.block_size
            table = req.group_block_ids[g] if req.group_block_ids else []
            out.extend((g, i) for i in range(min(skipped, len(table))) if table[i] != self.null_block)
        return out


def create_kv_cache_manager(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                            enable_caching: bool = True, record_block_contents: bool = False,
                            max_num_batched_tokens: int = 8192) -> KVCacheManager | HybridKVCacheManager:
    """Today's single-table manager for one full-attention group (or none given), so a
    full-attention model takes exactly the path it always has; the hybrid one otherwise."""
    if not groups or not is_hybrid(groups):
        return KVCacheManager(num_blocks, block_size, enable_caching, record_block_contents=record_block_contents)
    return HybridKVCacheManager(groups, num_blocks, block_size, enable_caching, record_block_contents,
                                max_num_batched_tokens)

