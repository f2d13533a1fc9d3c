"""The KV cache manager: prefix lookup, slot allocation and freeing per request,
on top of :class:`~engine.core.block_pool.BlockPool`.

A block gets a hash once it is full: ``hash((parent_hash, tuple(its token ids)))``
with the first block's parent ``NONE_HASH``, or under vLLM's ``cache_salt`` the salt's
own root (:func:`root_hash`), so equal hashes mean equal whole prefixes with equal
salts. Python's hash of a tuple of ints is deterministic across runs (it does not
depend on PYTHONHASHSEED). Requests compute their block hashes lazily, only as far
as they are needed.

Prefix-cache statistics are counted in tokens, as vLLM does: each lookup adds the
request's token count to the queries and the hit length to the hits.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.core.block_pool import BlockDeltas, BlockPool
from engine.core.request import Request
from engine.events.schema import (
    PREFIX_COMPLETE,
    PREFIX_DIVERGED,
    PREFIX_EVICTED,
    PREFIX_LAST_TOKEN,
    PREFIX_SHORT_PROMPT,
)

NONE_HASH = 0x6B7673636F7065  # parent "hash" of a request's first block


def root_hash(req: Request) -> int:
    """The parent of a request's first block: ``NONE_HASH``, or one derived from its
    ``cache_salt`` (sha256, not ``hash(str)``, which changes with PYTHONHASHSEED: KV events
    carry these hashes to other processes)."""
    salt = req.sampling.cache_salt if req.sampling is not None else None
    if not salt:
        return NONE_HASH
    return hash((NONE_HASH, int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_block_hashes(req: Request, num_full_blocks: int, block_size: int) -> list[int]:
    """The request's chained block hashes, computed lazily up to ``num_full_blocks``
    (every KV cache manager, single-group or hybrid, hashes the one chain)."""
    hashes = req.block_hashes
    if len(hashes) < num_full_blocks:
        tokens = req.token_ids
        parent = hashes[-1] if hashes else root_hash(req)
        for i in range(len(hashes), num_full_blocks):
            parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
            hashes.append(parent)
    return hashes


def prefix_stop(req: Request, hit_tokens: int, block_size: int, pool: BlockPool) -> list[Any]:
    """Where a prefix lookup of ``req`` that hit ``hit_tokens`` stopped, and why: a step
    event's ``prefix_lookups`` entry (engine/events/schema.py's ``PREFIX_*`` causes). The
    block after the hit is either beyond what a lookup may reuse (the prompt is shorter
    than a block, or its last block holds the last token, always recomputed) or its hash
    is not cached: evicted (the pool remembers when) or never there (diverged)."""
    num_tokens = len(req.token_ids)
    if num_tokens < block_size:
        return [hit_tokens, PREFIX_SHORT_PROMPT]
    stop = hit_tokens // block_size
    if stop >= (num_tokens - 1) // block_size:
        return [hit_tokens, PREFIX_LAST_TOKEN if num_tokens % block_size == 0 else PREFIX_COMPLETE]
    evicted = pool.evicted_at.get(req.block_hashes[stop])
    if evicted is not None:
        return [hit_tokens, PREFIX_EVICTED, evicted[0], evicted[1]]
    return [hit_tokens, PREFIX_DIVERGED]


class KVCacheManager:
    """Per-request block tables over one :class:`BlockPool`.

    A request's table is ``request.block_ids`` (positions in order).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 record_block_contents: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # vLLM's enable_kv_cache_events: step events say what each cached block holds
        self.record_block_contents = record_block_contents
        self.pool = BlockPool(num_blocks, block_size, enable_caching, record_block_contents)
        self.prefix_query_tokens = 0  # totals since start, in tokens
        self.prefix_hit_tokens = 0
        self.last_shortfall = (0, 0)  # (blocks needed, blocks free) of the last allocation refused

    # ------------------------------------------------------------------ hashing
    def _extend_block_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        return extend_block_hashes(req, num_full_blocks, self.block_size)

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached run of the request's full blocks: (block ids, hit tokens).

        Never the whole sequence: the last token is always recomputed so the model
        produces logits for it. Statistics are not touched here (a request that
        does not fit is looked up again next step); see :meth:`record_lookup`.
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = len(req.token_ids)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = self._extend_block_hashes(req, max_hit_blocks)
        lookup = self.pool.cached_block_map.get
        hits: list[int] = []
        for i in range(max_hit_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

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
        """Where the lookup that hit ``hit_tokens`` stopped and why (:func:`prefix_stop`)."""
        return prefix_stop(req, hit_tokens, self.block_size, self.pool)

    # -------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at its longest."""
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        num_computed_hit_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req``.

        ``computed_blocks`` / ``num_computed_hit_tokens`` are a prefix hit from
        :meth:`get_computed_blocks` for a request being admitted (its table must be
        empty). Returns the blocks appended to the table (hits first), or None,
        changing nothing, when the pool cannot supply them. Full blocks among the
        tokens known after this step are registered in the prefix cache now, before
        the forward pass, as vLLM does: a request admitted later in the same step
        may hit them because the step writes all KV before attention reads it.
        """
        pool = self.pool
        bs = self.block_size
        table = req.block_ids
        num_hits = len(computed_blocks) if computed_blocks else 0
        computed = req.num_computed_tokens + num_computed_hit_tokens
        num_needed = (computed + num_new_tokens + bs - 1) // bs - num_hits - len(table)
        if num_hits:
            assert computed_blocks is not None
            ref_cnt = pool.ref_cnt
            evictable_hits = sum(1 for b in computed_blocks if ref_cnt[b] == 0)
            if num_needed + evictable_hits > pool.num_free:
                self.last_shortfall = (num_needed + evictable_hits, pool.num_free)
                return None
            pool.touch(computed_blocks)
            new_blocks = list(computed_blocks)
            if num_needed > 0:
                new_blocks += pool.get_new_blocks(num_needed)
            table.extend(new_blocks)
            # hit blocks are already registered in the cache
            req.num_hashed_blocks = num_hits
        elif num_needed > 0:
            if num_needed > pool.num_free:
                self.last_shortfall = (num_needed, pool.num_free)
                return None
            new_blocks = pool.get_new_blocks(num_needed)
            table.extend(new_blocks)
        else:
            new_blocks = []
        if new_blocks:
            allocated = pool.deltas.allocated
            prior = allocated.get(req.request_id)
            if prior is None:
                allocated[req.request_id] = list(new_blocks)
            else:
                prior.extend(new_blocks)
        if self.enable_caching:
            num_tokens = len(req.token_ids)
            known = computed + num_new_tokens
            num_full = (known if known < num_tokens else num_tokens) // bs
            if num_full > req.num_hashed_blocks:
                self._cache_full_blocks(req, num_full)
        return new_blocks

    def _cache_full_blocks(self, req: Request, num_full_blocks: int) -> None:
        hashes = self._extend_block_hashes(req, num_full_blocks)
        table = req.block_ids
        cache_block = self.pool.cache_block
        block_hash = self.pool.block_hash
        if self.record_block_contents:
            self._cache_and_record(req, hashes, num_full_blocks)
            return
        for i in range(req.num_hashed_blocks, num_full_blocks):
            b = table[i]
            if block_hash[b] is None:
                cache_block(b, hashes[i])
        req.num_hashed_blocks = num_full_blocks

    def _cache_and_record(self, req: Request, hashes: list[int], num_full_blocks: int) -> None:
        """:meth:`_cache_full_blocks` recording what the blocks hold: one run of the
        request's consecutive new blocks, cut where a block is not cached by it (already
        hashed, or its content held by another block)."""
        table, tokens, bs = req.block_ids, req.token_ids, self.block_size
        pool = self.pool
        block_hash = pool.block_hash
        run = None
        start = 0  # the run's first position; its tokens are one slice once it ends
        for i in range(req.num_hashed_blocks, num_full_blocks):
            b = table[i]
            if block_hash[b] is None:
                if run is None:
                    run, start = pool.deltas.start_run(hashes[i - 1] if i else None), i
                if pool.cache_block(b, hashes[i], run):
                    continue
            if run is not None:
                run.token_ids = tokens[start * bs : i * bs]
                run = None
        if run is not None:
            run.token_ids = tokens[start * bs : num_full_blocks * bs]
        req.num_hashed_blocks = num_full_blocks

    # ------------------------------------------------------------------- free
    def free(self, req: Request) -> list[int]:
        """Release the request's blocks, tail first so its least-shared blocks are
        evicted before its prefix. Returns the released table (position order)."""
        table = req.block_ids
        if not table:
            return table
        self.pool.free_blocks(reversed(table))
        freed = self.pool.deltas.freed
        prior = freed.get(req.request_id)
        if prior is None:
            freed[req.request_id] = table
        else:
            prior.extend(table)
        req.block_ids = []
        req.num_hashed_blocks = 0
        return table

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
