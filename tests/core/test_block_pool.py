"""BlockPool: reference counts, LRU free queue, prefix-cache hashes, integrity."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool


def test_new_blocks_come_from_the_head_in_id_order() -> None:
    pool = BlockPool(8, 16)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.num_free == 5
    assert pool.ref_cnt[:4] == [1, 1, 1, 0]
    pool.check_integrity()


def test_freed_blocks_go_to_the_tail_in_the_given_order() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue_order() == [3, 2, 1, 0]
    assert pool.get_new_blocks(2) == [3, 2]
    pool.check_integrity()


def test_cached_free_block_counts_as_free_and_is_evicted_last() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 111)
    pool.free_blocks([a, b])
    assert pool.num_free == 4 and pool.usage == 0.0
    assert pool.num_cached_free == 1
    # blocks 2 and 3 were free before a and b, so they are reused first; a keeps its hash
    assert pool.get_new_blocks(2) == [2, 3]
    assert pool.lookup(111) == a
    assert pool.get_new_blocks(1) == [a]
    assert pool.lookup(111) is None
    assert pool.block_hash[a] is None
    assert pool.num_cached_free == 0
    assert pool.deltas.evicted == []  # cached and evicted within one record nets out
    pool.check_integrity()


def test_touch_takes_a_cached_block_back_out_of_the_free_queue() -> None:
    pool = BlockPool(3, 16)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 5)
    pool.free_blocks([a])
    assert a in pool.free_queue_order()
    pool.touch([a])
    assert a not in pool.free_queue_order()
    assert pool.ref_cnt[a] == 1 and pool.num_free == 2 and pool.num_cached_free == 0
    pool.touch([a])
    pool.free_blocks([a])
    assert pool.ref_cnt[a] == 1 and a not in pool.free_queue_order()
    pool.check_integrity([[a]])


def test_duplicate_content_is_not_cached_twice() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 9)
    assert not pool.cache_block(b, 9)
    assert pool.block_hash[b] is None and pool.lookup(9) == a
    pool.check_integrity()


def test_over_asking_and_double_free_raise() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more times"):
        pool.free_blocks([a])


def test_integrity_catches_a_table_that_disagrees_with_counts() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.get_new_blocks(2)
    pool.check_integrity([blocks])
    with pytest.raises(AssertionError, match="reference counts"):
        pool.check_integrity([blocks[:1]])
    pool.ref_cnt[3] = 1  # corrupt: referenced but still in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2, 16)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_ids() == set()
    pool.check_integrity()
