"""The pool of KV cache blocks: reference counts, the LRU free queue and the
prefix-cache hash map.

Blocks are plain integers ``0 .. num_blocks-1``. Per-block state lives in
parallel lists indexed by block id (reference count, cached hash, free-queue
links), so no Python object exists per block and every operation is O(1) per
block touched, never O(pool).

The free queue is a doubly linked list threaded through ``_prev``/``_next`` with
one sentinel node (index ``num_blocks``) that is both head and tail. It holds
truly free blocks and cached blocks whose count fell to 0; both count as free.
New blocks are taken from the head; freed blocks are appended at the tail, so a
freed cached block survives (and can be hit) until every block freed before it
has been reused: LRU eviction. A collections.deque cannot remove from the middle
in O(1), which a prefix hit on a free cached block needs.

Unlike vLLM, block 0 is reserved as the null block only when a sliding-window
group needs one (``reserve_null_block``): a full-attention pool uses all
``num_blocks``. The null block stands in a sliding-window
group's table for positions that lie outside the window; it is never free,
never hashed and never counted as used.

With several KV cache groups (engine/core/kv_cache_groups.py) one pool serves all
of them: a block id belongs to one group at a time, and the prefix cache is keyed
by (hash, group) as vLLM's ``BlockHashWithGroupId``, one hash map per group.

Every change that a block-table consumer must see is written into ``deltas``
(see :class:`BlockDeltas`); the scheduler swaps in a fresh one per step. With
``record_contents`` (vLLM's ``enable_kv_cache_events``) the deltas also say what
each newly cached block holds and which hash each evicted block lost, so a KV
cache events sink can be a fold of step events.
"""

from __future__ import annotations

from collections.abc import Iterable

EVICTIONS_REMEMBERED = 1 << 16  # evicted hashes kept to explain a later prefix miss (oldest dropped first)


class StoredRun:
    """Consecutive blocks of one request that entered the prefix cache in one step (vLLM's
    ``BlockStored``): their ids and hashes, the hash of the block before the first (None
    for a request's first block) and their token ids, ``block_size`` per block. Recorded
    only when asked (vLLM's ``enable_kv_cache_events``), one run per request and step, so
    a step with many cached blocks makes a few lists rather than a few per block."""

    __slots__ = ("block_ids", "dropped", "group", "hashes", "parent_hash", "token_ids")

    def __init__(self, parent_hash: int | None, group: int = 0) -> None:
        self.group = group  # the KV cache group whose blocks these are
        self.block_ids: list[int] = []
        self.hashes: list[int] = []
        self.parent_hash = parent_hash
        self.token_ids: list[int] = []
        self.dropped: list[int] = []  # positions evicted again within the step

    def pieces(self) -> list[StoredRun]:
        """The run without the blocks evicted again within the step, cut where they were
        (a piece after a cut names the evicted block's hash as its parent)."""
        if not self.dropped:
            return [self] if self.block_ids else []
        size = len(self.token_ids) // len(self.block_ids)
        out: list[StoredRun] = []
        piece: StoredRun | None = None
        dropped = set(self.dropped)
        for i, (block_id, block_hash) in enumerate(zip(self.block_ids, self.hashes, strict=True)):
            if i in dropped:
                piece = None
                continue
            if piece is None:
                piece = StoredRun(self.hashes[i - 1] if i else self.parent_hash, self.group)
                out.append(piece)
            piece.block_ids.append(block_id)
            piece.hashes.append(block_hash)
            piece.token_ids.extend(self.token_ids[i * size : (i + 1) * size])
        return out


class BlockDeltas:
    """Block changes of one scheduler step, in the form the ``step`` event carries.

    Per request and KV cache group (one list per group, group order):
    ``allocated_by_group`` request id -> block ids appended to its tables (prefix hits
    first, then new blocks); ``freed_by_group`` request id -> block ids it released by a
    finish, abort or preemption; ``window_freed_by_group`` the blocks a sliding-window
    group released because they left the window. ``cached`` block ids that are cached at
    the end of the step but were not registered before it (an ordered set; each maps to
    its group); ``evicted`` block ids that were cached before the step and lost that
    content during it (``evicted_groups``: the group each was cached in). With
    ``record_contents``, ``stored`` holds what the newly cached blocks hold
    (:class:`StoredRun`, in ``cached`` order) and ``evicted_hashes`` the hash each evicted
    block lost. Folding applies ``evicted`` before ``cached`` and ``allocated`` before
    ``freed``; with these net sets that order reproduces the pool exactly even when one
    block is evicted and re-cached within a step.

    ``grouped``: the step event names each change's group (several groups, or a window);
    one full-attention group's events carry the flat lists alone, as they always have.
    """

    __slots__ = ("_groups", "allocated_by_group", "cached", "evicted", "evicted_groups", "evicted_hashes",
                 "freed_by_group", "grouped", "num_groups", "prefix_hit_tokens", "prefix_query_tokens", "stored",
                 "window_freed_by_group")

    def __init__(self, record_contents: bool = False, num_groups: int = 1, grouped: bool = False) -> None:
        self.cached: dict[int, int] = {}  # block -> the group whose hash it now holds
        self.evicted: list[int] = []
        self.stored: list[StoredRun] | None = [] if record_contents else None
        self.evicted_hashes: list[int] | None = [] if record_contents else None
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_groups = num_groups
        self._groups = range(num_groups)
        self.grouped = grouped
        self.allocated_by_group: dict[str, list[list[int]]] = {}
        self.freed_by_group: dict[str, list[list[int]]] = {}
        self.window_freed_by_group: dict[str, list[list[int]]] = {}
        self.evicted_groups: list[int] = []

    def _group_lists(self, by_group: dict[str, list[list[int]]], request_id: str) -> list[list[int]]:
        lists = by_group.get(request_id)
        if lists is None:
            lists = by_group[request_id] = [[] for _ in self._groups]
        return lists

    def record_allocated(self, request_id: str, group: int, block_ids: list[int]) -> None:
        self._group_lists(self.allocated_by_group, request_id)[group].extend(block_ids)

    def record_freed(self, request_id: str, group: int, block_ids: list[int]) -> None:
        self._group_lists(self.freed_by_group, request_id)[group].extend(block_ids)

    def record_window_freed(self, request_id: str, group: int, block_ids: list[int]) -> None:
        self._group_lists(self.window_freed_by_group, request_id)[group].extend(block_ids)

    def all_allocated(self) -> dict[str, list[int]]:
        """Request id -> blocks appended to its tables, every group's, group order."""
        return flatten_groups(self.allocated_by_group)

    def all_freed(self) -> dict[str, list[int]]:
        """Request id -> blocks released by a finish, abort or preemption (every group's)."""
        return flatten_groups(self.freed_by_group)

    @property
    def records_contents(self) -> bool:
        return self.evicted_hashes is not None

    def start_run(self, parent_hash: int | None, group: int = 0) -> StoredRun:
        """A new run of stored blocks (only when recording contents)."""
        assert self.stored is not None
        run = StoredRun(parent_hash, group)
        self.stored.append(run)
        return run

    def record_cached(self, block_id: int, block_hash: int, run: StoredRun | None = None, group: int = 0) -> None:
        self.cached[block_id] = group
        if run is not None:
            run.block_ids.append(block_id)
            run.hashes.append(block_hash)

    def _drop_stored(self, block_id: int) -> None:
        """Mark the block's latest stored position as evicted again (rare: a scan
        here costs less than indexing every stored block)."""
        assert self.stored is not None
        for run in reversed(self.stored):
            for i in range(len(run.block_ids) - 1, -1, -1):
                if run.block_ids[i] == block_id and i not in run.dropped:
                    run.dropped.append(i)
                    return

    def record_evicted(self, block_id: int, block_hash: int, group: int = 0) -> None:
        if block_id in self.cached:
            # cached and evicted inside this step: net effect on the fold is nothing new
            del self.cached[block_id]
            if self.stored is not None:
                self._drop_stored(block_id)
        else:
            self.evicted.append(block_id)
            self.evicted_groups.append(group)
            if self.evicted_hashes is not None:
                self.evicted_hashes.append(block_hash)


def flatten_groups(by_group: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Request id -> its blocks, group after group (one group's list as it is)."""
    return {rid: lists[0] if len(lists) == 1 else [b for blocks in lists for b in blocks]
            for rid, lists in by_group.items()}


def group_counts(by_group: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Request id -> how many of its flattened blocks belong to each group."""
    return {rid: [len(blocks) for blocks in lists] for rid, lists in by_group.items()}


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with reference counts and a
    hash -> block map for prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 record_contents: bool = False, *, num_groups: int = 1, reserve_null_block: bool = False,
                 grouped_events: bool = False) -> None:
        if num_blocks <= (1 if reserve_null_block else 0):
            raise ValueError(f"num_blocks must be positive{' beyond the null block' if reserve_null_block else ''}, "
                             f"got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.record_contents = record_contents
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # one (block hash -> block id) map per KV cache group: vLLM keys by (hash, group)
        self.cached_block_maps: list[dict[int, int]] = [{} for _ in range(num_groups)]
        self.cached_block_map = self.cached_block_maps[0]
        self.block_group: list[int] = [0] * num_blocks  # the group whose hash a cached block holds
        self.num_groups = num_groups
        # the step events name each block change's group (BlockDeltas.grouped)
        self.grouped_events = grouped_events
        head = num_blocks  # sentinel
        # initial queue 0, 1, ..., n-1 so the lowest ids are handed out first
        self._next: list[int] = [*range(1, num_blocks + 1), 0]
        self._prev: list[int] = [head, *range(num_blocks)]
        self._in_free_queue: list[bool] = [True] * num_blocks
        self.num_free = num_blocks
        self.num_cached_free = 0  # free blocks still holding a hash (evictable hits)
        self.null_block: int | None = None
        if reserve_null_block:  # vLLM's null block: block 0, taken once and never returned
            self._unlink(0)
            self.ref_cnt[0] = 1
            self.null_block = 0
        self.num_usable = num_blocks - (1 if reserve_null_block else 0)
        self.deltas = self.new_deltas()
        # hash -> (step, block) of its latest eviction, so a prefix lookup that stops at an
        # evicted block can say when it went (bounded; ``step`` is set by the scheduler)
        self.evicted_at: dict[int, tuple[int, int]] = {}
        self.step = 0

    def new_deltas(self) -> BlockDeltas:
        """A fresh record of block changes, shaped for this pool."""
        return BlockDeltas(self.record_contents, self.num_groups, self.grouped_events)

    def take_deltas(self) -> BlockDeltas:
        """Hand over the block changes recorded so far and start a new record."""
        deltas, self.deltas = self.deltas, self.new_deltas()
        return deltas

    # ------------------------------------------------------------ free queue
    def _unlink(self, block_id: int) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._in_free_queue[block_id] = False
        self.num_free -= 1

    def _append(self, block_id: int) -> None:
        head = self.num_blocks
        tail = self._prev[head]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = head
        self._prev[head] = block_id
        self._in_free_queue[block_id] = True
        self.num_free += 1

    def free_queue_order(self) -> list[int]:
        """Free block ids from head (next to be reused) to tail. O(free); for tests."""
        out: list[int] = []
        head = self.num_blocks
        b = self._next[head]
        while b != head:
            out.append(b)
            b = self._next[b]
        return out

    # ------------------------------------------------------------- operations
    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (evicting any cached
        content they hold) with reference count 1. Caller checks ``num_free``."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.num_free} are free")
        out: list[int] = []
        nxt, ref_cnt, block_hash = self._next, self.ref_cnt, self.block_hash
        head = self.num_blocks
        for _ in range(n):
            b = nxt[head]
            self._unlink(b)
            h = block_hash[b]
            if h is not None:
                self._evict(b, h)
            ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict(self, block_id: int, block_hash: int) -> None:
        group = self.block_group[block_id]
        cached = self.cached_block_maps[group]
        if cached.get(block_hash) == block_id:
            del cached[block_hash]
        self.block_hash[block_id] = None
        self.num_cached_free -= 1
        self.deltas.record_evicted(block_id, block_hash, group)
        evicted_at = self.evicted_at
        evicted_at[block_hash] = (self.step, block_id)
        if len(evicted_at) > EVICTIONS_REMEMBERED:
            del evicted_at[next(iter(evicted_at))]

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on prefix-hit blocks; a free cached one leaves the free queue."""
        ref_cnt = self.ref_cnt
        for b in block_ids:
            if ref_cnt[b] == 0:
                self._unlink(b)
                self.num_cached_free -= 1
            ref_cnt[b] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 go to the tail of the
        free queue in the given order, keeping their hash (still hittable)."""
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        for b in ordered_block_ids:
            c = ref_cnt[b] - 1
            if c < 0:
                raise ValueError(f"block {b} freed more times than it was taken")
            ref_cnt[b] = c
            if c == 0:
                self._append(b)
                if block_hash[b] is not None:
                    self.num_cached_free += 1

    def cache_block(self, block_id: int, block_hash: int, run: StoredRun | None = None, group: int = 0) -> bool:
        """Register a full, in-use block of KV cache group ``group`` under its chained
        hash (``run``: the stored run it extends, when contents are recorded). Returns
        False (and leaves the block uncached) when another block of the group already
        holds that content: two requests that computed the same prefix in the same step."""
        cached = self.cached_block_maps[group]
        if block_hash in cached:
            return False
        cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_group[block_id] = group
        self.deltas.record_cached(block_id, block_hash, run, group)
        return True

    def lookup(self, block_hash: int, group: int = 0) -> int | None:
        return self.cached_block_maps[group].get(block_hash)

    # ------------------------------------------------------------------ state
    @property
    def num_used(self) -> int:
        """Blocks referenced by requests (the null block is neither used nor free)."""
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced; cached-but-free blocks count as free
        (vLLM's kv_cache_usage_perc, which leaves the null block out too)."""
        return (self.num_usable - self.num_free) / self.num_usable

    def cached_block_ids(self) -> set[int]:
        """Blocks currently holding a prefix-cache hash. O(pool); for tests and snapshots."""
        return {b for b, h in enumerate(self.block_hash) if h is not None}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only allowed when no block is in use."""
        if self.num_free != self.num_usable:
            return False
        for b, h in enumerate(self.block_hash):
            if h is not None:
                self._evict(b, h)
        return True

    def check_integrity(self, owners: Iterable[list[int]] | None = None) -> None:
        """Assert the pool's invariants; raises AssertionError naming the broken one.

        free + referenced = total; the free queue is exactly the blocks with count
        0, each once; the hash map and the per-block hashes agree; the cached-free
        counter matches. With ``owners`` (every live request's block list) also:
        each block's count equals the number of tables holding it, and no table
        holds a block twice. O(pool); for tests.
        """
        order = self.free_queue_order()
        null = self.null_block
        assert len(order) == len(set(order)), "a block is in the free queue twice"
        assert len(order) == self.num_free, f"free queue has {len(order)} blocks, counter says {self.num_free}"
        zero = {b for b, c in enumerate(self.ref_cnt) if c == 0}
        assert set(order) == zero, "free queue differs from the blocks with reference count 0"
        assert all(c >= 0 for c in self.ref_cnt), "negative reference count"
        referenced = self.num_usable - len(zero)
        assert self.num_free + referenced == self.num_usable, "free + referenced != usable"
        assert null is None or (null not in zero and self.block_hash[null] is None), "the null block left its place"
        mapped: set[int] = set()
        for group, cached in enumerate(self.cached_block_maps):
            for h, b in cached.items():
                assert self.block_hash[b] == h, f"hash map points at block {b} which holds another hash"
                assert self.block_group[b] == group, f"block {b} is cached under group {group} but says another"
                mapped.add(b)
        hashed = {b for b, h in enumerate(self.block_hash) if h is not None}
        assert hashed == mapped, "a block holds a hash that the hash map does not point to"
        assert self.num_cached_free == len(hashed & zero), "cached-free counter is wrong"
        if owners is not None:
            counts = [0] * self.num_blocks
            for table in owners:
                real = [b for b in table if b != null]
                assert len(real) == len(set(real)), "a request holds the same block twice"
                for b in real:
                    counts[b] += 1
            if null is not None:
                counts[null] = self.ref_cnt[null]
            assert counts == self.ref_cnt, "reference counts differ from the request tables"
