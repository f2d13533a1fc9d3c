"""The KV cache manager: the scheduler's one face on the KV cache (vLLM V1's
``KVCacheManager``), whatever the model's KV cache groups: prefix lookup and its
statistics, slot allocation and freeing per request, over a
:class:`~engine.core.kv_cache_coordinator.KVCacheCoordinator` (one single-type manager
per group, one shared :class:`~engine.core.block_pool.BlockPool`).

A request's tables are ``Request.block_tables``: one list per group, in the groups'
order (one list for a model whose layers all attend fully).

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
from collections.abc import Sequence
from typing import Any

from engine.core.block_pool import BlockDeltas, BlockPool
from engine.core.kv_cache_coordinator import KVCacheCoordinator
from engine.core.kv_cache_groups import KVCacheGroup, resolve_groups
from engine.core.request import BlockTables, Request
from engine.core.single_type_kv_cache import cdiv as cdiv  # re-exported: callers' and tests' helper
from engine.events.step_records import (
    PREFIX_COMPLETE,
    PREFIX_DIVERGED,
    PREFIX_EVICTED,
    PREFIX_LAST_TOKEN,
    PREFIX_SHORT_PROMPT,
    PREFIX_WINDOW,
    WAIT_BLOCKS,
    WAIT_NEVER_FITS,
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


def extend_block_hashes(req: Request, num_full_blocks: int, block_size: int) -> list[int]:
    """The request's chained block hashes, computed lazily up to ``num_full_blocks``
    (one chain for every KV cache group)."""
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
    event's ``prefix_lookups`` entry (engine/events/step_records.py's ``PREFIX_*`` causes). The
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
    """Per-request block tables, one per KV cache group, over one :class:`BlockPool`.

    ``kv_cache_groups`` () stands for one full-attention group (every layer);
    ``max_num_batched_tokens`` bounds what a sliding-window group holds beside its window.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 record_block_contents: bool = False, *, kv_cache_groups: Sequence[KVCacheGroup] = (),
                 max_num_batched_tokens: int = 8192) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # vLLM's enable_kv_cache_events: step events say what each cached block holds
        self.record_block_contents = record_block_contents
        self.coordinator = KVCacheCoordinator(resolve_groups(kv_cache_groups), num_blocks, block_size,
                                              enable_caching, record_block_contents, max_num_batched_tokens)
        self.pool: BlockPool = self.coordinator.pool
        self.groups = self.coordinator.groups
        self.specs = self.coordinator.specs
        self.null_block = self.pool.null_block  # a window group's stand-in for positions it freed
        self._has_window = bool(self.coordinator.sliding_groups)
        self.prefix_query_tokens = 0  # totals since start, in tokens
        self.prefix_hit_tokens = 0
        self.last_shortfall = (0, 0)  # (blocks needed, blocks free) of the last allocation refused

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, req: Request) -> tuple[BlockTables, int]:
        """Longest cached prefix every group serves: (per-group hit tables, hit tokens).

        Never the whole sequence: the last token is always recomputed so the model
        produces logits for it. Statistics are not touched here (a request that
        does not fit is looked up again next step); see :meth:`record_lookup`.
        """
        if not self.enable_caching:
            return self.coordinator.empty_tables(), 0
        max_hit_blocks = (len(req.token_ids) - 1) // self.block_size
        hashes = extend_block_hashes(req, max_hit_blocks, self.block_size)
        return self.coordinator.find_longest_cache_hit(hashes, max_hit_blocks)

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
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        full_tokens = self.coordinator.full_attention_hit_tokens(req.block_hashes, max_blocks)
        if full_tokens is not None and full_tokens > hit_tokens:
            return [hit_tokens, PREFIX_WINDOW, full_tokens]
        return prefix_stop(req, hit_tokens, self.block_size, self.pool)

    def explain_refusal(self, req: Request) -> list[Any]:
        """Why the pool refused the queue's head (a step event's waiting reason): short now,
        or never (more blocks than the pool has, even empty)."""
        ever = self.blocks_needed(req.num_prompt_tokens + req.max_tokens)
        if ever > self.pool.num_usable:
            return [WAIT_NEVER_FITS, ever, self.pool.num_usable]
        needed, free = self.last_shortfall
        return [WAIT_BLOCKS, needed, free]

    # -------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, every group."""
        return self.coordinator.blocks_needed(num_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_usable

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: BlockTables | None = None,
        num_computed_hit_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req`` in every group.

        ``computed_blocks`` / ``num_computed_hit_tokens`` are a prefix hit from
        :meth:`get_computed_blocks` for a request being admitted (its tables must be
        empty). Window blocks the request no longer reads are freed first, even when the
        rest does not fit. Returns the real blocks appended (every group's, group order;
        hits first), or None, changing nothing else, when the pool cannot supply them.
        Full blocks among the tokens known after this step are registered in the prefix
        cache now, before the forward pass, as vLLM does: a request admitted later in the
        same step may hit them because the step writes all KV before attention reads it.
        """
        bs = self.block_size
        computed = req.num_computed_tokens
        if computed and self._has_window:
            self.coordinator.remove_skipped_blocks(req, computed)
        computed += num_computed_hit_tokens
        known = computed + num_new_tokens
        num_slot_blocks = (known + bs - 1) // bs  # cdiv inline: this runs per request per step
        tables = req.block_tables
        if num_computed_hit_tokens or not tables or len(tables[0]) < num_slot_blocks:
            hits = computed_blocks if num_computed_hit_tokens else None
            appended = self._allocate(req, hits, num_slot_blocks)
            if appended is None:
                return None
        else:  # every group's table covers the same positions: none needs a block (most decodes)
            appended = []
        if self.enable_caching:
            num_tokens = len(req.token_ids)
            num_full = (known if known < num_tokens else num_tokens) // bs
            if num_full > req.num_hashed_blocks:
                self.coordinator.cache_full_blocks(req, extend_block_hashes(req, num_full, bs), num_full)
        return appended

    def _allocate(self, req: Request, hits: BlockTables | None, num_slot_blocks: int) -> list[int] | None:
        """Every group's blocks for ``num_slot_blocks`` positions, or None (recording the
        shortfall) when the pool cannot supply them."""
        coordinator = self.coordinator
        num_needed = coordinator.num_blocks_to_allocate(req.block_tables, hits, num_slot_blocks)
        num_free = self.pool.num_free
        if num_needed > num_free:
            self.last_shortfall = (num_needed, num_free)
            return None
        return coordinator.allocate(req, hits, num_slot_blocks)

    # ------------------------------------------------------------------- free
    def free(self, req: Request) -> list[int]:
        """Release every group's blocks, the request's tail first so its least-shared
        blocks are evicted before its prefix. Returns the real blocks released (group
        order, positions in order)."""
        return self.coordinator.free(req)

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
        return self.coordinator.window_violations(req, num_computed_tokens)
