"""The KV cache manager over several groups (its coordinator and single-type managers):
vLLM's grouping rule, the window rule, prefix hits across groups, and one full-attention
group as the one-group case of the same code."""

from __future__ import annotations

import pytest

from engine.core.kv_cache import KVCacheManager
from engine.core.kv_cache_groups import (
    FULL,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVCacheGroup,
    KVCacheSpec,
    groups_from_config,
    groups_to_config,
    kv_cache_groups,
    parse_layer_pattern,
)
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.single_type_kv_cache import FullAttentionManager, SlidingWindowManager
from engine.core.step_loop import FixedTokenExecutor, run_step

S, F = SLIDING_ATTENTION, FULL_ATTENTION


def test_gemma3_270m_groups_five_sliding_groups_of_three_then_one_full() -> None:
    layer_types = parse_layer_pattern("5:1", 18)
    groups = kv_cache_groups(layer_types, 512)
    assert [g.spec.sliding_window for g in groups] == [512] * 5 + [None]
    assert [len(g.layers) for g in groups] == [3] * 6
    assert groups[0].layers == (0, 6, 12) and groups[1].layers == (1, 7, 13)  # layers[i::num_groups]
    assert groups[5].layers == (5, 11, 17)
    assert groups_from_config(groups_to_config(groups)) == groups


def test_grouping_uses_the_larger_count_when_it_is_under_one_and_a_half_times_the_smaller() -> None:
    # gpt-oss-20b + eagle: 12 sliding + 13 full -> groups of 13 (one padded), not 12
    groups = kv_cache_groups([S, F] * 12 + [F], 128)
    assert [len(g.layers) for g in groups] == [12, 13]
    # 2 full + 3 sliding: 3 >= 2 * 1.5, so groups of 2: the full pair, then sliding (0, 2) and (1,)
    groups = kv_cache_groups([F, S, S, F, S], 64)
    assert [(g.spec.sliding_window, g.layers) for g in groups] == [(None, (0, 3)), (64, (1, 4)), (64, (2,))]


def test_all_full_attention_is_one_group_of_the_one_manager() -> None:
    groups = kv_cache_groups([F] * 4, None)
    assert groups == (KVCacheGroup(FULL, (0, 1, 2, 3)),)
    for named in (groups, ()):  # () is what a config names one full-attention group
        kv = KVCacheManager(8, 4, kv_cache_groups=named)
        assert [type(m) for m in kv.coordinator.managers] == [FullAttentionManager]
        assert kv.pool.null_block is None and kv.pool.num_usable == 8 and not kv.pool.grouped_events
    kv = KVCacheManager(8, 4, kv_cache_groups=kv_cache_groups([S, F], 8))
    assert [type(m) for m in kv.coordinator.managers] == [SlidingWindowManager, FullAttentionManager]
    assert kv.pool.null_block == 0 and kv.pool.num_usable == 7 and kv.pool.grouped_events


def test_skipped_tokens_follow_vllms_example() -> None:
    spec = KVCacheSpec(4)
    assert spec.num_skipped_tokens(7) == 4  # the next token (7) attends to 4..7
    assert spec.num_skipped_tokens(2) == 0
    assert FULL.num_skipped_tokens(1000) == 0


def _hybrid(window: int = 4, num_blocks: int = 32, block_size: int = 2) -> KVCacheManager:
    groups = (KVCacheGroup(KVCacheSpec(window), (0,)), KVCacheGroup(FULL, (1,)))
    return KVCacheManager(num_blocks, block_size, kv_cache_groups=groups)


def test_a_sliding_group_frees_the_blocks_that_left_the_window_and_keeps_the_table_length() -> None:
    kv = _hybrid(window=4, block_size=2)
    null = kv.pool.null_block
    assert null == 0 and kv.pool.num_free == 31  # block 0 is the null block
    req = Request("a", list(range(1, 11)), 8)
    assert kv.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    sliding, full = req.block_tables
    assert len(sliding) == len(full) == 5 and null not in sliding
    kv.take_deltas()
    kv.allocate_slots(req, 1)  # token 10 attends to 7..10: tokens 0..6 skipped, blocks 0..2 wholly
    assert sliding[:3] == [null] * 3 and null not in sliding[3:] and len(sliding) == 6
    assert null not in full and len(full) == 6
    deltas = kv.take_deltas()
    window_freed = deltas.window_freed_by_group["a"]
    assert len(window_freed[0]) == 3 and window_freed[1] == [] and "a" not in deltas.freed_by_group
    assert kv.window_violations(req, 10) == []
    kv.pool.check_integrity(req.block_tables)
    freed = kv.free(req)
    assert len(freed) == 3 + 6
    assert kv.pool.num_free == kv.pool.num_usable
    kv.pool.check_integrity()


def test_a_window_hit_needs_only_the_blocks_inside_the_window_and_searches_from_the_right() -> None:
    # window 5, block 2: a hit ending at position p needs ceil(4 / 2) = 2 blocks before p
    groups = (KVCacheGroup(KVCacheSpec(5), (0,)),)
    kv = KVCacheManager(64, 2, kv_cache_groups=groups)
    null = kv.pool.null_block
    prompt = list(range(100, 120))
    first = Request("first", prompt, 4)
    kv.allocate_slots(first, 20)
    first.num_computed_tokens = 20
    kv.free(first)
    table_hashes = first.block_hashes
    for pos in range(4):  # positions 0..3 lose their cached content: the window hit does not need them
        b = kv.pool.lookup(table_hashes[pos])
        assert b is not None
        kv.pool._evict(b, table_hashes[pos])
    kv.pool.check_integrity()
    second = Request("second", [*prompt, 7], 4)
    hits, hit_tokens = kv.get_computed_blocks(second)
    assert hit_tokens == 20  # positions 8, 9 (the window before 20) are cached
    assert hits is not None
    assert hits[0][:8] == [null] * 8 and null not in hits[0][8:]
    # a full-attention group would have hit nothing: its scan stops at position 0
    hybrid = KVCacheManager(64, 2, kv_cache_groups=(KVCacheGroup(KVCacheSpec(5), (0,)), KVCacheGroup(FULL, (1,))))
    third = Request("third", [*prompt, 7], 4)
    hybrid.allocate_slots(Request("w", prompt, 4), 20)
    w_hits, w_tokens = hybrid.get_computed_blocks(third)
    assert w_tokens == 20 and w_hits is not None
    assert len(w_hits[0]) == len(w_hits[1]) == 10


def test_the_hit_is_the_longest_prefix_every_group_serves() -> None:
    kv = _hybrid(window=4, block_size=2)
    prompt = list(range(1, 13))
    writer = Request("writer", prompt, 4)
    kv.allocate_slots(writer, 12)
    writer.num_computed_tokens = 12
    kv.free(writer)
    # the full group loses position 3's block: the common hit stops before it
    full_block = kv.pool.lookup(writer.block_hashes[3], group=1)
    assert full_block is not None
    kv.pool._evict(full_block, writer.block_hashes[3])
    reader = Request("reader", [*prompt, 99], 4)
    hits, hit_tokens = kv.get_computed_blocks(reader)
    assert hit_tokens == 6 and hits is not None
    assert [len(h) for h in hits] == [3, 3]
    assert kv.allocate_slots(reader, 7, hits, hit_tokens) is not None
    kv.pool.check_integrity(reader.block_tables)


def _run(sched: Scheduler, prompts: list[list[int]], steps: int = 200) -> list[tuple]:
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, 6, arrival_time=0.0), 0.0)
    out = []
    executor = FixedTokenExecutor(7)
    for step in range(steps):
        if not sched.has_unfinished():
            break
        result = run_step(sched, executor, None, float(step))
        o = result.output
        out.append((o.allocated, o.freed, sorted(o.deltas.cached), list(o.deltas.evicted), o.preempted_req_ids,
                    o.finished, o.num_blocks_used))
    return out


@pytest.mark.parametrize("caching", [True, False])
def test_a_named_full_attention_group_decides_as_the_default_one(caching: bool) -> None:
    config = SchedulerConfig(num_blocks=12, block_size=2, max_num_batched_tokens=8, enable_prefix_caching=caching)
    prompts = [[1, 2, 3, 4, 5, i] for i in range(6)] + [list(range(40, 52))]
    default = Scheduler(config)
    named = Scheduler(config)
    named.kv = KVCacheManager(12, 2, caching, kv_cache_groups=(KVCacheGroup(FULL, (0,)),), max_num_batched_tokens=8)
    assert _run(default, prompts) == _run(named, prompts)


def test_a_request_is_rejected_only_when_every_groups_most_blocks_exceed_the_pool() -> None:
    groups = (KVCacheGroup(KVCacheSpec(4), (0,)), KVCacheGroup(FULL, (1,)))
    sched = Scheduler(SchedulerConfig(num_blocks=12, block_size=2, max_num_batched_tokens=4, max_model_len=64,
                                      kv_cache_groups=groups))
    # 16 tokens: 8 full blocks + a window of min(8, ceil((3 + 4) / 2) + 1 = 5) = 13 > 11 usable
    reason = sched.rejection_reason(Request("big", list(range(1, 13)), 4))
    assert reason is not None and "13 blocks" in reason and "11" in reason
    assert sched.rejection_reason(Request("ok", list(range(1, 9)), 4)) is None  # 6 + 5 <= 11
